"""The one error table of every front: each error a request can meet -> its gRPC status code, HTTP status,
OpenAI error ``type``, metrics outcome and retry headers -- and the one procedure every front runs on an
error, :func:`answer`: classify, log once, count once.  gRPC (:mod:`cluster.serving.fronts.app`) and HTTP
(:mod:`cluster.serving.fronts.http_app`, its API-key middleware included) only render the :class:`Answer`.

Retry headers: ``Retry-After: 1`` on 429 / 503 (RFC 9110, sec. 10.2.3: the client may come back shortly);
``x-should-retry: false`` on 500 / 504, the header the official OpenAI SDKs read before their own retry rule
(which would otherwise retry every 5xx): a request that failed inside the engine or ran past its deadline
fails the same way again.  gRPC codes are kept as names (``grpc.StatusCode[name]``).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from cluster.errors import (
    DeadlineExceededError,
    ModelUnavailableError,
    OverloadedError,
    ParamError,
    shown,
)
from cluster.serving.ops.auth import Unauthenticated
from protos.guard import INTERNAL_DETAILS as INTERNAL_MESSAGE   # what the guarded gRPC proxy lets through

log = logging.getLogger("specserve.errors")
COUNTED = "_specserve_counted"            # set on an error the coordinator has counted (metrics.record)


class UnknownModel(Exception):
    """A ``model`` that this server does not serve (HTTP 404, as vLLM answers; gRPC NOT_FOUND)."""

    def __init__(self, name: Any, served: str):
        self.name = name
        super().__init__(f"the model {shown(name)} does not exist (served: {served!r}; see GET /v1/models)")


@dataclass(frozen=True)
class ErrorKind:
    """How every front answers one kind of error."""

    grpc_code: str                     # a grpc.StatusCode name
    http_status: int
    openai_type: str                   # the OpenAI error object's ``type``
    outcome: str                       # the ``specserve_requests{outcome}`` label (metrics.OUTCOMES)
    refused: bool = False              # a client's mistake or a full server: logged as one info line

    @property
    def internal(self) -> bool:
        """The message carries no internals: the details stay in the server log."""
        return self.http_status == 500

    @property
    def headers(self) -> dict[str, str] | None:
        if self.http_status in (429, 503):
            return {"Retry-After": "1"}
        if self.http_status in (500, 504):
            return {"x-should-retry": "false"}
        return None


# first match wins (order: subclasses before their bases)
ERRORS: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (Unauthenticated, ErrorKind("UNAUTHENTICATED", 401, "authentication_error", "unauthenticated", True)),
    (ParamError, ErrorKind("INVALID_ARGUMENT", 400, "invalid_request_error", "invalid", True)),
    (UnknownModel, ErrorKind("NOT_FOUND", 404, "not_found_error", "not_found", True)),
    (OverloadedError, ErrorKind("RESOURCE_EXHAUSTED", 429, "server_overloaded", "overloaded", True)),
    (ModelUnavailableError, ErrorKind("UNAVAILABLE", 503, "service_unavailable", "unavailable")),
    (DeadlineExceededError, ErrorKind("DEADLINE_EXCEEDED", 504, "timeout", "deadline")),
    (asyncio.CancelledError, ErrorKind("CANCELLED", 499, "cancelled", "cancelled")),   # 499: nginx's
)
INTERNAL = ErrorKind("INTERNAL", 500, "internal_error", "error")


def classify(exc: BaseException) -> ErrorKind:
    """The table's row for ``exc`` (anything unlisted is an internal error)."""
    return next((kind for t, kind in ERRORS if isinstance(exc, t)), INTERNAL)


def message(exc: BaseException) -> str:
    """What a client is told: our own bounded message, or none of an internal error's details."""
    return INTERNAL_MESSAGE if classify(exc).internal else str(exc)


def param_of(exc: BaseException) -> str | None:
    """The OpenAI error's ``param``: the parameter a refusal names."""
    return exc.name if isinstance(exc, ParamError) else "model" if isinstance(exc, UnknownModel) else None


def refusal_outcome(exc: BaseException) -> str | None:
    """The outcome a front counts for ``exc`` (raised before a response), or None when the coordinator
    already counted the request (an error of an admitted request, marked by ``Metrics.record``)."""
    return None if getattr(exc, COUNTED, False) else classify(exc).outcome


@dataclass(frozen=True)
class Answer:
    """What a front renders for one error: the table's row, the message a client may see, and the parameter
    a refusal names (the OpenAI error's ``param``)."""

    kind: ErrorKind
    message: str
    param: str | None


def answer(exc: BaseException, metrics, strategy: str | None) -> Answer:
    """The one error procedure of every front: ``exc``'s row of the table, logged once (an internal error with
    its traceback; a refusal as one info line per request) and counted once in ``metrics`` under ``strategy``
    (not again when the coordinator already counted the admitted request).  Never raises for metrics."""
    kind, msg = classify(exc), message(exc)
    if kind.internal:
        log.error("internal error", exc_info=exc)
    elif kind.refused:
        log.info("refused (%s / %d): %s", kind.grpc_code, kind.http_status, msg)
    outcome = refusal_outcome(exc)
    if outcome is not None and metrics is not None:
        metrics.record(strategy, outcome)
    return Answer(kind, msg, param_of(exc))
