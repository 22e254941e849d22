"""API keys for the serving endpoints (docs/operator-guide.md, "Secure").

A replica reads its keys once at start-up: the API key from ``cluster.api_key_file`` (a mounted secret) if
set, else from the environment variable ``cluster.api_key_env``; the operator key from
``cluster.operator_key_env``.  Without an API key, auth is off (one warning line at start-up).  When on,
every request but health checks must carry ``authorization: Bearer <key>`` (gRPC metadata or HTTP
header); the operator key is accepted wherever the API key is and also unlocks other clients' request ids
in ServerInfo.  Keys are compared in constant time (``hmac.compare_digest``) and never logged or echoed.
"""
from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cluster.errors import ConfigError

log = logging.getLogger("specserve.auth")

USER, OPERATOR = "user", "operator"
UNAUTHENTICATED_MESSAGE = "missing or invalid API key (send 'authorization: Bearer <key>')"


class Unauthenticated(Exception):
    """A request without a valid key (gRPC UNAUTHENTICATED / HTTP 401)."""

    def __init__(self):
        super().__init__(UNAUTHENTICATED_MESSAGE)


def read_key(env_name: str | None, file_path: str | None = None,
             environ: Mapping[str, str] | None = None) -> str | None:
    """The key from ``file_path`` if given (surrounding whitespace stripped), else from the environment
    variable ``env_name``; None if neither yields one.  A configured file that cannot be read or is empty
    is an error: a missing secret must not silently turn auth off."""
    if file_path:
        try:
            with open(file_path, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as e:
            raise ConfigError(f"cluster.api_key_file: cannot read {file_path!r} ({e.strerror})") from None
        if not key:
            raise ConfigError(f"cluster.api_key_file: {file_path!r} is empty")
        return key
    environ = os.environ if environ is None else environ
    return ((environ.get(env_name) or "").strip() or None) if env_name else None


def key_matches(presented: str | None, expected: str | None) -> bool:
    """Constant-time comparison (in the key's length); False when either side is missing."""
    if not presented or not expected:
        return False
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


def bearer_token(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (scheme case-insensitive), else None."""
    if not value or not isinstance(value, str):
        return None
    scheme, _, token = value.strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def metadata_token(metadata: Iterable | None) -> str | None:
    """The bearer token in gRPC invocation metadata (``(key, value)`` pairs; keys are lower case)."""
    for k, v in metadata or ():
        if isinstance(k, str) and k.lower() == "authorization":
            return bearer_token(v if isinstance(v, str) else None)
    return None


@dataclass(frozen=True)
class Keys:
    api_key: str | None = None
    operator_key: str | None = None

    @property
    def enabled(self) -> bool:
        return self.api_key is not None

    def role(self, token: str | None) -> str | None:
        """OPERATOR, USER or None (refused).  With auth off everyone is an operator (the behaviour without
        keys: ServerInfo lists every request id)."""
        if not self.enabled:
            return OPERATOR
        # both comparisons always run, so the time does not tell which key was close
        op = key_matches(token, self.operator_key)
        user = key_matches(token, self.api_key)
        return OPERATOR if op else USER if user else None


def load_keys(cluster, environ: Mapping[str, str] | None = None) -> Keys:
    """The keys of ``cluster`` (a ClusterSpec), read now; logs one warning when auth is off."""
    api = read_key(cluster.api_key_env, cluster.api_key_file, environ)
    op = read_key(cluster.operator_key_env, None, environ) if api else None
    if api is None:
        log.warning("no API key (cluster.api_key_file / $%s): the server is UNAUTHENTICATED; anyone who reaches "
                    "its ports can generate and see every request id", cluster.api_key_env)
    return Keys(api, op)
