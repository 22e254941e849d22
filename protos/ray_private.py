"""Every private Ray Serve internal specserve patches, in one guarded place, checked against the Ray it was
written for.

Ray Serve 2.60 has no public hook for three things the gRPC front does:

* **cancel forwarding** -- Serve's gRPC proxy loses a client's cancel that arrives while a chunk is being
  sent (:mod:`protos.guard` explains it); :func:`wrap_handler_factory` wraps the proxy server's private
  ``service_handler_factory`` (``gRPCGenericServer``) so a cancel always lands where Serve handles it, and a
  lost replica answers ``UNAVAILABLE`` instead of ``INTERNAL`` with Ray's text;
* **the gRPC listen address and TLS** -- ``gRPCOptions`` has a port but no host and no credentials;
  :func:`replace_grpc_binding` (run by :mod:`cluster.serving.ops.bind_hook` in every worker process of a
  ``specserve up`` job) replaces ``ray.serve._private.default_impl.add_grpc_address``;
* **replicas' internal gRPC server address** -- ``ray.serve._private.replica.add_port_to_grpc_server``,
  from ``[::]:0`` to the node's address, replaced by the same hook.

:data:`WRITTEN_FOR` is the Ray version these were written for (pyproject.toml pins it).  On any other Ray
every patch stays off (:func:`patches_apply`) and the server is plain Ray Serve: stream cancels are forwarded
where Serve forwards them (most, not all), a lost replica answers Serve's ``INTERNAL``, and the gRPC proxy
listens where Serve binds it (``[::]:port``, plaintext; the ingress terminates TLS, as on KubeRay).
``specserve up`` needs the binding (its gRPC host and TLS are part of the config), so there
:func:`check_startup` refuses another Ray with :class:`RayVersionError` instead of serving without them;
a plain ``serve deploy`` / KubeRay application logs one warning and runs on the fallback.

This module runs inside Serve's proxy: it imports nothing of the project, and ray only inside functions.
"""
from __future__ import annotations

import logging
from importlib import metadata

WRITTEN_FOR = "2.60.0"
log = logging.getLogger("specserve.ray_private")


class RayVersionError(RuntimeError):
    """The installed Ray is not the one the private patches were written for, and they are needed."""


def ray_version() -> str:
    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:
        return "none"


def patches_apply(version: str | None = None) -> bool:
    """Whether the private patches may be applied on Ray ``version`` (default: the installed one)."""
    return (version or ray_version()) == WRITTEN_FOR


def check_startup(needs_binding: bool, version: str | None = None) -> bool:
    """At start-up: True when the patches apply.  Otherwise :class:`RayVersionError` where the gRPC binding
    (host, TLS) is needed, else one warning and False: plain Ray Serve (see the module docstring)."""
    version = version or ray_version()
    if patches_apply(version):
        return True
    why = (f"Ray {version} is installed; specserve's patches of Ray Serve internals were written for Ray "
           f"{WRITTEN_FOR} (protos/ray_private.py)")
    if needs_binding:
        raise RayVersionError(f"{why}: `specserve up` cannot bind gRPC to its configured host or serve it over "
                              f"TLS on it. Install ray[serve]=={WRITTEN_FOR}, or deploy with plain Serve "
                              "(`specserve serve-config` + `serve deploy`, or KubeRay), where the ingress "
                              "terminates TLS (docs/operator-guide.md)")
    log.warning("%s: running plain Ray Serve -- no cancel forwarding while a chunk is sent, a lost replica "
                "answers INTERNAL (docs/operator-guide.md)", why)
    return False


def wrap_handler_factory(server, wrap, marker: str, version: str | None = None) -> bool:
    """Replace ``server.service_handler_factory`` (Serve's gRPC proxy server only) by ``wrap(factory)``, once
    (``marker``: the attribute a wrapped factory carries); a no-op on another Ray or another server."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None or getattr(factory, marker, False) or not patches_apply(version):
        return False
    server.service_handler_factory = wrap(factory)
    return True


def replace_grpc_binding(add_grpc_address, replica_address) -> None:
    """Serve's proxy binds through ``add_grpc_address(server, address)``; a replica's internal server through
    Serve's own function, its address first mapped by ``replica_address(address)``."""
    if not patches_apply():
        raise RayVersionError(f"Ray {ray_version()}: the gRPC binding hook was written for Ray {WRITTEN_FOR}")
    from ray.serve._private import default_impl, replica

    original = replica.add_port_to_grpc_server

    def add_port_to_grpc_server(server, address: str):
        return original(server, replica_address(address))

    default_impl.add_grpc_address = add_grpc_address
    replica.add_port_to_grpc_server = add_port_to_grpc_server
