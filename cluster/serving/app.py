"""The Ray Serve deployment: one replica = one serving unit (a coordinator and its actors), serving the
gRPC API (:mod:`cluster.serving.grpc_api`) through Serve's gRPC proxy and the OpenAI-style HTTP API
(:mod:`cluster.serving.http_api`); plus ``start_serve`` and the ``app_builder`` for ``serve run`` / KubeRay."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc

from cluster.config.schema import Config, load_config
from cluster.engine.request import GenerationResult, PreparedRequest
from cluster.errors import (
    DeadlineExceededError,
    ModelUnavailableError,
    OverloadedError,
    ParamError,
    shown,
)
from cluster.serving.auth import (
    OPERATOR,
    Unauthenticated,
    bearer_token,
    load_keys,
    metadata_token,
)
from cluster.serving.coordinator import Coordinator
from cluster.serving.grpc_api import (
    SERVICE,
    SERVICER_FUNCTIONS,
    MalformedRequest,
    log,
    malformed_error,
    request_from_proto,
    result_to_proto,
    server_info,
)
from cluster.serving.http_api import (
    _oai_error,
    _openai_finish,
    parse_body,
    read_body,
    request_from_openai,
)
from cluster.serving.metrics import make_metrics, strategy_label
from protos import specserve_pb2 as pb

# -- the deployment --------------------------------------------------------------------------------
RETRY_AFTER = {"Retry-After": "1"}        # seconds; on HTTP 429 (overloaded) and 503 (unavailable / not ready)


class _Abort(Exception):
    """Carries a sanitized message to Serve after the gRPC status was set on the context."""


class SpecServeDeployment:
    """A Serve replica: one coordinator (one serving unit). Decorated with ``serve.deployment`` in
    :func:`build_app`."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.keys = load_keys(cfg.cluster)        # first: a missing key file fails the replica at once
        self.coord = Coordinator(cfg, metrics=make_metrics())
        self._warm = threading.Thread(target=self._warmup, name="specserve-warmup", daemon=True)
        self._warm.start()

    def _warmup(self) -> None:
        try:
            self.coord.warmup()
        except Exception:
            log.exception("warm-up failed")

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
        """Map ``exc`` to a status on ``ctx`` and return ``empty`` (the method's empty response): a refused
        request is answered, not raised through Serve (which would log a traceback for each).  Messages are
        ours and bounded (ParamError echoes a truncated value); the metric label is a validated strategy."""
        if isinstance(exc, Unauthenticated):
            code, msg, outcome = grpc.StatusCode.UNAUTHENTICATED, str(exc), "unauthenticated"
        elif isinstance(exc, ParamError):
            code, msg, outcome = grpc.StatusCode.INVALID_ARGUMENT, str(exc), "invalid"
        elif isinstance(exc, OverloadedError):
            code, msg, outcome = grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "overloaded"
        elif isinstance(exc, ModelUnavailableError):
            code, msg, outcome = grpc.StatusCode.UNAVAILABLE, str(exc), "error"
        elif isinstance(exc, DeadlineExceededError):
            code, msg, outcome = grpc.StatusCode.DEADLINE_EXCEEDED, str(exc), "error"
        else:
            log.error("internal error", exc_info=exc)
            code, msg, outcome = grpc.StatusCode.INTERNAL, "internal error (details in the server log)", "error"
        if outcome in ("invalid", "overloaded", "unauthenticated"):
            log.info("refused (%s): %s", code.name, msg)                # one line per refused request
        if outcome != "error" and self.coord.metrics is not None:
            self.coord.metrics.record(strategy_label(strategy or self.cfg.engine.strategy), outcome)
        if ctx is None or empty is None:
            raise _Abort(msg) from None
        ctx.set_code(code)
        ctx.set_details(msg)
        return empty

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        try:
            self._grpc_role(grpc_context)
            req = request_from_proto(request, self.cfg)
            return result_to_proto(await self.coord.generate(req))
        except asyncio.CancelledError:
            raise
        except Exception as e:                     # noqa: BLE001 - mapped to a status code
            return self._fail(grpc_context, e, request.strategy, pb.GenerateResponse())

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None):
        try:
            self._grpc_role(grpc_context)
            req = request_from_proto(request, self.cfg)
            async for chunk in self.coord.stream(req):
                yield pb.GenerateChunk(text=chunk.text, token_ids=chunk.token_ids,
                                       finish_reason=chunk.finish_reason or "",
                                       result=result_to_proto(chunk.result) if chunk.result else None)
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

    # -- HTTP (OpenAI completions) ------------------------------------------------------------------
    async def __call__(self, request):
        from starlette.responses import JSONResponse
        path = request.url.path.rstrip("/")
        if path.endswith("/health"):                   # exempt from auth (load balancers, probes)
            if self.coord.ready:
                return JSONResponse({"ready": True})
            return JSONResponse({"ready": False}, status_code=503, headers=RETRY_AFTER)
        if self.keys.enabled and self.keys.role(bearer_token(request.headers.get("authorization"))) is None:
            log.info("refused (401): missing or invalid API key")
            if self.coord.metrics is not None:
                self.coord.metrics.record(strategy_label(self.cfg.engine.strategy), "unauthenticated")
            return JSONResponse(_oai_error(str(Unauthenticated()), "authentication_error"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        if path.endswith("/v1/models"):
            return JSONResponse({"object": "list", "data": [{"id": self.cfg.cluster.app_name, "object": "model",
                                                             "owned_by": "specserve"}]})
        if not path.endswith("/v1/completions"):
            return JSONResponse(_oai_error(f"no route {path}", "not_found"), status_code=404)
        if request.method != "POST":
            return JSONResponse(_oai_error("use POST", "invalid_request_error"), status_code=405)
        try:
            body = parse_body(await read_body(request))      # size and nesting checked before parsing
            req, stream = request_from_openai(body, self.cfg)
            req = self.coord.validate(req)             # fixes request id and seed for every chunk
            if stream:
                return await self._sse(req)
            r = await self.coord.generate(req)
            return JSONResponse(self._completion(r, r.text, r.finish_reason, usage=True))
        except asyncio.CancelledError:
            raise
        except ParamError as e:
            log.info("refused (400): %s", e)                  # one line per refused request
            return JSONResponse(_oai_error(str(e), "invalid_request_error", e.name), status_code=400)
        except OverloadedError as e:
            log.info("refused (429): %s", e)
            return JSONResponse(_oai_error(str(e), "server_overloaded"), status_code=429, headers=RETRY_AFTER)
        except ModelUnavailableError as e:
            return JSONResponse(_oai_error(str(e), "service_unavailable"), status_code=503, headers=RETRY_AFTER)
        except DeadlineExceededError as e:
            return JSONResponse(_oai_error(str(e), "timeout"), status_code=504)
        except Exception:                          # noqa: BLE001
            log.exception("internal error")
            return JSONResponse(_oai_error("internal error (details in the server log)", "internal_error"),
                                status_code=500)

    async def _sse(self, req: PreparedRequest):
        from starlette.responses import StreamingResponse
        gen = self.coord.stream(req)
        first = await gen.__anext__()              # validation / overload errors surface as HTTP codes

        async def events():
            try:
                chunk = first
                while True:
                    if chunk.text or chunk.finish_reason:
                        payload = self._completion(chunk.result, chunk.text, chunk.finish_reason,
                                                   usage=chunk.result is not None, rid=req.rid)
                        yield f"data: {json.dumps(payload)}\n\n"
                    if chunk.finish_reason is not None:
                        break
                    chunk = await gen.__anext__()
                yield "data: [DONE]\n\n"
            finally:
                await gen.aclose()
        return StreamingResponse(events(), media_type="text/event-stream")

    def _completion(self, r: GenerationResult | None, text: str, finish: str | None, *, usage: bool,
                    rid: str | None = None) -> dict:
        out = {"id": "cmpl-" + (r.request_id if r else rid or ""), "object": "text_completion",
               "created": int(time.time()), "model": self.cfg.cluster.app_name,
               "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": _openai_finish(finish)}]}
        if usage and r is not None:
            out["usage"] = {"prompt_tokens": r.stats.prompt_tokens, "completion_tokens": r.stats.generated_tokens,
                            "total_tokens": r.stats.prompt_tokens + r.stats.generated_tokens}
            out["specserve"] = {"token_ids": r.token_ids, "seed": r.seed, "finish_reason": r.finish_reason,
                                "stats": r.stats.to_dict()}
        return out


# -- deploying -------------------------------------------------------------------------------------
def build_app(cfg: Config):
    """The bound Serve application for ``cfg`` (one deployment; replicas = serving units)."""
    from ray import serve
    cl = cfg.cluster
    dep = serve.deployment(SpecServeDeployment, name="SpecServe").options(
        num_replicas=cl.replicas,
        ray_actor_options={"num_cpus": cl.coordinator.num_cpus, "num_gpus": cl.coordinator.num_gpus},
        max_ongoing_requests=cfg.engine.capacity + 32,    # headroom beyond admission for ServerInfo / health
        health_check_period_s=10, health_check_timeout_s=60, graceful_shutdown_timeout_s=5)
    return dep.bind(cfg)


def start_serve(cfg: Config, *, address: str | None = None, blocking: bool = False, num_cpus: int | None = None):
    """Start (or join) Ray, start Serve's HTTP and gRPC proxies on the configured ports, deploy."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions
    cl = cfg.cluster
    if not ray.is_initialized():
        kw = {"address": address} if address else {"num_cpus": num_cpus}
        ray.init(namespace="specserve", include_dashboard=False, **kw)
    serve.start(http_options={"host": cl.http_host, "port": cl.http_port},
                grpc_options=gRPCOptions(port=cl.grpc_port, grpc_servicer_functions=SERVICER_FUNCTIONS))
    return serve.run(build_app(cfg), name=cl.app_name, route_prefix="/", blocking=blocking)


def app_builder(args: dict):
    """Serve application builder (``import_path: cluster.serving.app:app_builder``, ``args: {config: PATH}``):
    what a KubeRay RayService's ``serveConfigV2`` deploys (see k8s/).  The Serve config's
    ``grpc_options`` / ``http_options`` must match the config's ``cluster`` ports."""
    return build_app(load_config(args.get("config", "configs/local.yaml")))
