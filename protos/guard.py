"""Guarded request deserializers for Ray Serve's gRPC proxy: a message over MAX_MESSAGE_BYTES, or one that is
not a valid encoding of its type, becomes a :class:`MalformedRequest` (answered ``INVALID_ARGUMENT`` by the
handlers) instead of Serve's ``UNKNOWN``, before it is parsed.

This module runs inside the proxy, so it imports only grpc and the generated stubs (not the ``cluster``
package, which loads torch).  ``MAX_MESSAGE_BYTES`` must equal :data:`cluster.engine.request.MAX_MESSAGE_BYTES`
(a test holds them equal).
"""
from __future__ import annotations

import grpc

MAX_MESSAGE_BYTES = 8 << 20

GUARDED_SERVICER_FUNCTIONS = ["protos.guard.add_specserve_servicer", "protos.guard.add_health_servicer"]


# -- guarded deserializers (they run in Serve's gRPC proxy) -----------------------------------------
class MalformedRequest:
    """What a guarded deserializer hands on instead of a message it refuses (too large, or not a valid
    encoding of its type); the handlers answer it with ``INVALID_ARGUMENT``.  ``strategy`` and ``service``
    are the fields the handlers read of their requests."""

    strategy = service = ""

    def __init__(self, allowed: str, value: str):
        self.allowed, self.value = allowed, value


def _guarded(parse):
    kind = getattr(getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None), "full_name", "request")

    def deserialize(data: bytes):
        if len(data) > MAX_MESSAGE_BYTES:
            return MalformedRequest(f"a {kind} message of at most {MAX_MESSAGE_BYTES} bytes", f"{len(data)} bytes")
        try:
            return parse(data)
        except Exception:                  # noqa: BLE001 - protobuf's DecodeError and kin
            return MalformedRequest(f"a valid {kind} message", f"{len(data)} undecodable bytes")
    return deserialize


class _Captured:
    """Stands in for the server while a generated ``add_*_to_server`` registers its method handlers."""

    def __init__(self):
        self.services: dict[str, dict] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        for h in handlers:
            methods = {k.rsplit("/", 1)[-1]: v for k, v in h._method_handlers.items()}
            self.services.setdefault(h.service_name(), methods)

    def add_registered_method_handlers(self, service: str, methods: dict) -> None:
        self.services[service] = dict(methods)


def _add_guarded(add_generated, servicer, server) -> None:
    captured = _Captured()
    add_generated(servicer, captured)
    for service, methods in captured.services.items():
        methods = {m: h._replace(request_deserializer=_guarded(h.request_deserializer)) for m, h in methods.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, methods),))
        if hasattr(server, "add_registered_method_handlers"):
            server.add_registered_method_handlers(service, methods)


def add_specserve_servicer(servicer, server) -> None:
    """``add_SpecServeServicer_to_server`` with guarded request deserializers."""
    from protos import specserve_pb2_grpc
    _add_guarded(specserve_pb2_grpc.add_SpecServeServicer_to_server, servicer, server)


def add_health_servicer(servicer, server) -> None:
    """The standard ``grpc.health.v1.Health`` service with guarded request deserializers."""
    from grpc_health.v1 import health_pb2_grpc
    _add_guarded(health_pb2_grpc.add_HealthServicer_to_server, servicer, server)
