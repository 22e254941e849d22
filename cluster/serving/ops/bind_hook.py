"""A Ray worker-process setup hook: Serve's gRPC listeners on the address we choose, with TLS when configured.

Why a hook (docs/operator-guide.md, "Secure"): Ray Serve 2.60's ``gRPCOptions`` has a port but no host and no
server credentials.  Its proxy binds ``[::]:port`` in plaintext (``ray.serve._private.grpc_util.
start_grpc_server`` -> ``default_impl.add_grpc_address``) and every replica binds its inter-deployment gRPC
server to ``[::]:0`` (``ray.serve._private.replica``), whatever the node's address.  ``specserve up`` passes
this hook in the job's ``runtime_env`` (``worker_process_setup_hook``), which Serve's controller, proxies and
replicas inherit; in each worker process it replaces those two module attributes so that

* the proxy listens on ``$SPECSERVE_GRPC_HOST`` (``specserve up --grpc-host``; 127.0.0.1 by default) and,
  with ``$SPECSERVE_GRPC_TLS_CERT`` / ``$SPECSERVE_GRPC_TLS_KEY`` (PEM files), only over TLS
  (``grpc.ssl_server_credentials``, RFC 8446 via gRPC's own TLS stack);
* a replica's inter-deployment server listens on its node's address (127.0.0.1 on a local cluster).

Both replaced functions are private to Ray: the replacing happens in :mod:`protos.ray_private`, only on the
Ray it was written for (``specserve up`` refuses another at start-up), and ``tests/serving/test_security.py``
measures the listening sockets.
Without the hook (``serve deploy``, KubeRay) Serve binds as above and the ingress terminates TLS.
"""
from __future__ import annotations

import os

from protos.ray_private import replace_grpc_binding

GRPC_HOST_ENV = "SPECSERVE_GRPC_HOST"
TLS_CERT_ENV = "SPECSERVE_GRPC_TLS_CERT"
TLS_KEY_ENV = "SPECSERVE_GRPC_TLS_KEY"
HOOK = "cluster.serving.ops.bind_hook.install"


def hook_env(host: str, cert: str | None = None, key: str | None = None) -> dict[str, str]:
    """The job's ``runtime_env["env_vars"]`` that tell :func:`install` where and how to listen."""
    env = {GRPC_HOST_ENV: host}
    if cert and key:
        env.update({TLS_CERT_ENV: os.path.abspath(cert), TLS_KEY_ENV: os.path.abspath(key)})
    return env


def server_credentials():
    """TLS credentials from the configured PEM files, or None (plaintext)."""
    import grpc
    cert, key = os.environ.get(TLS_CERT_ENV), os.environ.get(TLS_KEY_ENV)
    if not (cert and key):
        return None
    with open(cert, "rb") as c, open(key, "rb") as k:
        return grpc.ssl_server_credentials([(k.read(), c.read())])


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


def install() -> None:
    """Run by Ray in every worker process of the job (a no-op where the variables are not set)."""
    host = os.environ.get(GRPC_HOST_ENV)
    if not host:
        return
    import ray
    creds = server_credentials()

    def add_grpc_address(server, address: str) -> None:        # Serve's proxy: "[::]:<grpc_port>"
        target = f"{host}:{_port(address)}"
        if creds is None:
            server.add_insecure_port(target)
        else:
            server.add_secure_port(target, creds)

    node_ip = ray.util.get_node_ip_address()
    replace_grpc_binding(add_grpc_address, lambda address: f"{node_ip}:{_port(address)}")   # replicas: "[::]:0"
