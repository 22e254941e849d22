"""The Ray Serve deployment: one replica = one serving unit (a coordinator and its actors), serving the
gRPC API (:mod:`cluster.serving.fronts.grpc_api`) through Serve's gRPC proxy and the OpenAI-style HTTP API
(:mod:`cluster.serving.fronts.http_api`); plus ``start_serve`` and the ``app_builder`` for ``serve run`` / KubeRay."""
from __future__ import annotations

import asyncio

import grpc

from cluster.config.schema import Config, config_from_dict, load_config
from cluster.errors import ConfigError, shown
from cluster.serving.ops.auth import (
    OPERATOR,
    Unauthenticated,
    load_keys,
    metadata_token,
)
from cluster.serving.control.coordinator import Coordinator
from cluster.serving.ops.deploy import DEPLOYMENT, deployment_options, serve_config
from cluster.serving.ops.error_table import answer
from cluster.serving.fronts.grpc_api import (
    SERVICE,
    MalformedRequest,
    chunk_to_proto,
    fields_from_proto,
    malformed_error,
    result_to_proto,
    server_info,
)
from cluster.serving.fronts.http_app import build_http_app
from cluster.serving.ops.metrics import make_metrics
from cluster.serving.fronts.requests import admit
from protos import specserve_pb2 as pb
from protos.ray_private import check_startup

# -- the deployment --------------------------------------------------------------------------------


class _Abort(Exception):
    """Carries a sanitized message to Serve after the gRPC status was set on the context."""


class SpecServeDeployment:
    """A Serve replica: one coordinator (one serving unit). Decorated with ``serve.deployment`` in
    :func:`build_app`."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.keys = load_keys(cfg.cluster)        # first: a missing key file fails the replica at once
        self.coord = Coordinator(cfg, metrics=make_metrics(cfg.cluster.app_name))
        # warm before the constructor returns: Serve routes to a replica (a new unit when autoscaling adds
        # one, or a restarted one) only once it is warm, and a rolling update waits for it
        self.coord.warmup()

    def __del__(self):
        """Serve calls this when it removes the replica, after draining its requests (up to
        ``cluster.drain_timeout_s``): stop the step loop and every actor of the unit."""
        shutdown = getattr(getattr(self, "coord", None), "shutdown", None)
        if shutdown is not None:
            shutdown()

    def draft_timing(self, reset: bool = False) -> dict | None:
        """The draft call's hop totals since the last reset (``bench --suite served``; a handle call, no route)."""
        return self.coord.draft_timing(reset)

    # Serve's replica health check: every actor of the unit must answer
    def check_health(self) -> None:
        self.coord.health()

    # -- auth (health checks are exempt) -----------------------------------------------------------
    def _grpc_role(self, ctx) -> str:
        """The caller's role from ``authorization: Bearer <key>`` metadata; raises Unauthenticated."""
        if not self.keys.enabled:
            return OPERATOR
        role = self.keys.role(metadata_token(ctx.invocation_metadata() if ctx is not None else ()))
        if role is None:
            raise Unauthenticated()
        return role

    # -- gRPC ---------------------------------------------------------------------------------------
    def _fail(self, ctx, exc: BaseException, strategy: str | None, empty=None):
        """Render the one error procedure's answer (:func:`cluster.serving.ops.error_table.answer`) as a status on
        ``ctx`` and return ``empty`` (the method's empty response): a refused request is answered, not raised
        through Serve (which would log a traceback for each).  Messages are ours and bounded (ParamError
        echoes a truncated value); the metric label is a validated strategy."""
        ans = answer(exc, self.coord.metrics, strategy or self.cfg.engine.strategy)
        if ctx is None or empty is None:
            raise _Abort(ans.message) from None
        ctx.set_code(grpc.StatusCode[ans.kind.grpc_code])
        ctx.set_details(ans.message)
        return empty

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        try:
            self._grpc_role(grpc_context)
            fields = fields_from_proto(request)
            req = await admit(self.coord, self.cfg, fields)
            return result_to_proto(await self.coord.generate(req), fields.structured)
        except asyncio.CancelledError:
            raise
        except Exception as e:                     # noqa: BLE001 - mapped to a status code
            return self._fail(grpc_context, e, request.strategy, pb.GenerateResponse())

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None):
        try:
            self._grpc_role(grpc_context)
            fields = fields_from_proto(request)
            req = await admit(self.coord, self.cfg, fields)
            async for chunk in self.coord.stream(req):
                yield chunk_to_proto(chunk, fields.structured)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:                     # noqa: BLE001 - one empty chunk carries the status
            yield self._fail(grpc_context, e, request.strategy, pb.GenerateChunk())

    async def ServerInfo(self, request: pb.ServerInfoRequest, grpc_context=None) -> pb.ServerInfoResponse:
        """Other clients' request ids only for an operator (with auth off: everyone)."""
        try:
            role = self._grpc_role(grpc_context)
        except Unauthenticated as e:
            return self._fail(grpc_context, e, None, pb.ServerInfoResponse())
        return await asyncio.to_thread(server_info, self.coord, request_ids=role == OPERATOR)

    async def Check(self, request, grpc_context=None):
        from grpc_health.v1 import health_pb2
        if isinstance(request, MalformedRequest):
            return self._fail(grpc_context, malformed_error(request), None, health_pb2.HealthCheckResponse())
        if request.service not in ("", SERVICE):
            if grpc_context is None:
                raise _Abort("unknown service")
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {shown(request.service)} (known: '', {SERVICE})")
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        status = health_pb2.HealthCheckResponse.SERVING if self.coord.ready else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, grpc_context=None):
        """Health status now, then whenever it changes (until the client cancels)."""
        from grpc_health.v1 import health_pb2
        last = None
        while True:
            status = health_pb2.HealthCheckResponse.SERVING if self.coord.ready else \
                health_pb2.HealthCheckResponse.NOT_SERVING
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(1.0)

    # -- HTTP (OpenAI completions): a FastAPI app behind Serve's ASGI ingress (see build_app) -----------
    def __serve_build_asgi_app__(self):
        """Called by Ray Serve once per replica, after ``__init__``: the routes of
        :mod:`cluster.serving.fronts.http_app` over this replica's coordinator."""
        return build_http_app(self)


# -- deploying -------------------------------------------------------------------------------------
def build_app(cfg: Config):
    """The bound Serve application for ``cfg`` (one deployment; replicas = serving units).  On a Ray other than
    the one protos/ray_private.py was written for it runs as plain Serve (one warning; docs/operator-guide.md)."""
    from ray import serve
    check_startup(needs_binding=False)
    # serve.ingress() without an app: Serve builds it per replica with __serve_build_asgi_app__; the gRPC
    # methods stay methods of the same class, which Serve's gRPC proxy calls by name
    dep = serve.deployment(serve.ingress()(SpecServeDeployment), name=DEPLOYMENT).options(
        **deployment_options(cfg))
    return dep.bind(cfg)


def start_serve(cfg: Config, *, address: str | None = None, blocking: bool = False, num_cpus: int | None = None):
    """Start (or join) Ray, then deploy :func:`cluster.serving.ops.deploy.serve_config` of ``cfg`` (what KubeRay
    deploys too): Serve's HTTP and gRPC proxies on the configured ports, the application from ``cfg``."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions
    if not ray.is_initialized():
        kw = {"address": address} if address else {"num_cpus": num_cpus}
        ray.init(namespace="specserve", include_dashboard=False, **kw)
    sc = serve_config(cfg, cfg.source)
    serve.start(proxy_location=sc["proxy_location"], http_options=sc["http_options"],
                grpc_options=gRPCOptions(**sc["grpc_options"]))
    (app,) = sc["applications"]
    return serve.run(build_app(cfg), name=app["name"], route_prefix=app["route_prefix"], blocking=blocking)


def app_builder(args: dict):
    """Serve application builder (``import_path: cluster.serving.fronts.app:app_builder``): what ``specserve
    serve-config`` and a KubeRay RayService's ``serveConfigV2`` deploy (see k8s/).  ``args.config`` is a config
    file's path where Serve runs, or the config itself inline (a mapping; ``args.source`` names the file it was
    written from): an edit of serveConfigV2 then redeploys the new config without a new image."""
    config = args.get("config", "configs/local.yaml")
    if isinstance(config, dict):
        return build_app(config_from_dict(config, source=f"serveConfigV2 ({args.get('source', 'inline')})"))
    if not isinstance(config, str):
        raise ConfigError(f"serveConfigV2 args.config: a config file path or a config mapping, got "
                          f"{type(config).__name__}")
    return build_app(load_config(config))
