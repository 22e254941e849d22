"""Guarded request deserializers for Ray Serve's gRPC proxy: a message over MAX_MESSAGE_BYTES, or one that is
not a valid encoding of its type, becomes a :class:`MalformedRequest` (answered ``INVALID_ARGUMENT`` by the
handlers) instead of Serve's ``UNKNOWN``, before it is parsed.

This module runs inside the proxy, so it imports only grpc and the generated stubs (not the ``cluster``
package, which loads torch).  ``MAX_MESSAGE_BYTES`` must equal :data:`cluster.engine.request.MAX_MESSAGE_BYTES`
(a test holds them equal).
"""
from __future__ import annotations

import asyncio

import grpc

from protos.ray_private import wrap_handler_factory

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


# -- stream cancellation that Serve's proxy would lose ------------------------------------------------
# Ray Serve's gRPC proxy (ray 2.60, serve/_private/proxy.py ``send_request_to_replica``) forwards a client's
# cancel to the replica only while it is awaiting the replica's next chunk: there a CancelledError reaches
# ``ProxyResponseGenerator`` which cancels the replica call.  A cancel that arrives while the proxy's
# generator is parked at ``yield`` (the chunk is being sent to the client) becomes a GeneratorExit that the
# proxy's ``except BaseException`` swallows, and the replica call runs to its end (some of the cancelled
# streams).  Serve offers no hook for this, so we wrap the proxy's own streaming handler (a private patch,
# applied through protos/ray_private.py only on the Ray it was written for): a pump task keeps
# the proxy's generator always inside that await (it asks for the next chunk as soon as one arrives and
# queues it), and when the RPC ends early (the client cancels or disconnects: gRPC's done callback, or our
# generator being closed) the pump task is cancelled, i.e. the cancel lands exactly where Serve handles it.
_PUMPED = "_specserve_pumped"


# Our handlers answer INTERNAL only with this text (cluster.serving.fronts.app).  Any other INTERNAL comes from Serve's
# proxy itself: the replica's actor died or restarted (Ray's message names its pid and node address).
INTERNAL_DETAILS = "internal error (details in the server log)"
REPLICA_LOST = "the serving replica failed or restarted; retry the request"
PUSHBACK = "grpc-retry-pushback-ms"


class _LiveContext:
    """The RPC's servicer context as Serve's proxy handler sees it.

    - grpc's context must not be touched once the RPC has ended (``peer()`` on a finished call crashes the
      process), but Serve's handler, cancelled from the pump, still logs the peer and sets a status
      afterwards: the peer and metadata are read while the RPC is live, and once it has ended every other
      method is a no-op.
    - A lost replica reaches clients as ``UNAVAILABLE`` (which standard retry policies retry) with a plain
      message, not as Serve's ``INTERNAL`` with Ray's text (pid, node address); see ``INTERNAL_DETAILS``."""

    def __init__(self, context):
        self._ctx, self.ended = context, False
        self._peer, self._metadata = context.peer(), context.invocation_metadata()

    def peer(self):
        return self._peer

    def invocation_metadata(self):
        return self._metadata

    def set_details(self, details):
        if self.ended:
            return
        if self._ctx.code() == grpc.StatusCode.INTERNAL and details != INTERNAL_DETAILS:
            self._ctx.set_code(grpc.StatusCode.UNAVAILABLE)
            # the request had reached its replica (it may have generated already): tell a retrying client
            # not to re-send it (gRFC A6: a negative grpc-retry-pushback-ms stops the channel's retries)
            self._ctx.set_trailing_metadata(((PUSHBACK, "-1"),))
            details = REPLICA_LOST
        self._ctx.set_details(details)

    def __getattr__(self, name):
        attr = getattr(self._ctx, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            return None if self.ended else attr(*args, **kwargs)
        return call


def _pumped(handler):
    """The proxy's ``unary_stream(request, context)`` handler, with cancels always forwarded (see above)."""
    async def unary_stream(request, context):
        queue: asyncio.Queue = asyncio.Queue()          # unbounded: at most one chunk per generated token
        end = object()
        live = _LiveContext(context)

        async def pump():
            try:
                async for message in handler(request, live):
                    queue.put_nowait(message)
            except BaseException as e:                  # noqa: BLE001 - raised by the RPC below
                queue.put_nowait(e)
            finally:
                queue.put_nowait(end)

        task = asyncio.ensure_future(pump())

        def ended(_ctx=None):                           # the client cancelled / disconnected, or we returned
            live.ended = True
            task.cancel()                               # a no-op once the pump has finished
        context.add_done_callback(ended)
        try:
            while (message := await queue.get()) is not end:
                if isinstance(message, BaseException):
                    raise message
                yield message
        finally:
            ended()
    return unary_stream


def _unary(handler):
    """The proxy's ``unary_unary(request, context)`` handler over a :class:`_LiveContext`."""
    async def unary_unary(request, context):
        live = _LiveContext(context)
        try:
            return await handler(request, live)
        finally:
            live.ended = True
    return unary_unary


def _pumping_factory(factory):
    def service_handler_factory(service_method, streaming_type):
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        kind = getattr(streaming_type, "name", "")
        return _pumped(handler) if kind == "UNARY_STREAM" else _unary(handler) if kind == "UNARY_UNARY" \
            else handler
    setattr(service_handler_factory, _PUMPED, True)
    return service_handler_factory


def _add_guarded(add_generated, servicer, server) -> None:
    wrap_handler_factory(server, _pumping_factory, _PUMPED)      # Serve's proxy server, on the Ray it was written for
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
