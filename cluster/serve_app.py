"""The Ray Serve application: gRPC ``specserve.v1.SpecServe`` + OpenAI-compatible ``/v1/completions``.

One deployment replica = one serving unit (coordinator + its drafters + its target group, see
:mod:`cluster.coordinator`), so ``cluster.replicas`` scales whole units.  gRPC goes through Serve's
gRPC proxy (methods ``Generate``, ``GenerateStream``, ``ServerInfo`` and the standard
``grpc.health.v1.Health/Check``, SERVING only after warm-up); HTTP through Serve's HTTP proxy
(``POST /v1/completions`` incl. ``"stream": true`` as server-sent events, ``GET /v1/models``,
``GET /health``).

Errors: a :class:`cluster.errors.ParamError` becomes ``INVALID_ARGUMENT`` / HTTP 400 naming field,
allowed range and value; :class:`cluster.errors.OverloadedError` becomes ``RESOURCE_EXHAUSTED`` /
HTTP 429; anything else ``INTERNAL`` / 500 with a sanitized message (the traceback stays in the
server log).  A client that cancels or disconnects stops its generation (see the coordinator).
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

import grpc

from protos import specserve_pb2 as pb
from .config import Config
from .engine import GenerationRequest, GenerationResult
from .errors import OverloadedError, ParamError, check_int
from .sampling import SamplingParams
from .strategies import REGISTRY

log = logging.getLogger("specserve.serve")

SERVICE = "specserve.v1.SpecServe"
SERVICER_FUNCTIONS = ["protos.specserve_pb2_grpc.add_SpecServeServicer_to_server",
                      "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"]
MAX_REQUEST_ID = 128


# -- requests --------------------------------------------------------------------------------------
def request_from_proto(m: pb.GenerateRequest, cfg: Config) -> GenerationRequest:
    """A GenerationRequest from the proto; unset optional fields take the config's defaults."""
    gen = cfg.generation
    sampling = SamplingParams(temperature=m.temperature if m.HasField("temperature") else gen.temperature,
                              top_p=m.top_p if m.HasField("top_p") else gen.top_p,
                              top_k=m.top_k if m.HasField("top_k") else gen.top_k)
    return _request(cfg, prompt=m.prompt or None, prompt_ids=list(m.prompt_ids) or None,
                    max_new_tokens=m.max_new_tokens if m.HasField("max_new_tokens") else gen.max_new_tokens,
                    sampling=sampling, seed=m.seed if m.HasField("seed") else None, stop=tuple(m.stop),
                    strategy=m.strategy or None, options=dict(m.options), ignore_eos=m.ignore_eos,
                    request_id=m.request_id or None)


def _request(cfg: Config, **kw) -> GenerationRequest:
    rid = kw.get("request_id")
    if rid is not None and not (0 < len(rid) <= MAX_REQUEST_ID and rid.isprintable()):
        raise ParamError("request_id", f"1 to {MAX_REQUEST_ID} printable characters", rid)
    kw["max_new_tokens"] = check_int("max_new_tokens", kw["max_new_tokens"], 1, cfg.engine.max_new_tokens_limit)
    return GenerationRequest(**kw)


def request_from_openai(body: Any, cfg: Config) -> tuple[GenerationRequest, bool]:
    """(request, stream) from an OpenAI completions body (extensions: top_k, strategy, options,
    ignore_eos). Unset sampling fields take the server config's defaults."""
    if not isinstance(body, dict):
        raise ParamError("body", "a JSON object", type(body).__name__)
    prompt = body.get("prompt")
    text, ids = None, None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                      # a batch of one
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        ids = prompt
    else:
        raise ParamError("prompt", "a string or a list of token ids (one prompt per request)", prompt)
    n = body.get("n", 1)
    if n != 1:
        raise ParamError("n", "1 (one completion per request)", n)
    for name in ("echo", "logprobs", "suffix"):
        if body.get(name) not in (None, False):
            raise ParamError(name, "unset (not supported)", body.get(name))
    if body.get("best_of") not in (None, 1):
        raise ParamError("best_of", "1 or unset", body.get("best_of"))
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)):
        raise ParamError("stop", "a string or a list of strings", stop)
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ParamError("options", "an object of strategy options", options)
    strategy = body.get("strategy")
    if strategy is not None and not isinstance(strategy, str):
        raise ParamError("strategy", "one of " + ", ".join(sorted(REGISTRY)), strategy)
    gen = cfg.generation
    sampling = SamplingParams(temperature=_get(body, "temperature", gen.temperature),
                              top_p=_get(body, "top_p", gen.top_p), top_k=_get(body, "top_k", gen.top_k))
    max_tokens = check_int("max_tokens", _get(body, "max_tokens", gen.max_new_tokens), 1,
                           cfg.engine.max_new_tokens_limit)
    req = _request(cfg, prompt=text, prompt_ids=ids, max_new_tokens=max_tokens,
                   sampling=sampling, seed=body.get("seed"), stop=tuple(stop), strategy=strategy,
                   options=options, ignore_eos=bool(body.get("ignore_eos", False)), request_id=None)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ParamError("stream", "true or false", stream)
    return req, stream


def _get(body: dict, key: str, default):
    v = body.get(key)
    return default if v is None else v


# -- responses -------------------------------------------------------------------------------------
def stats_to_proto(s) -> pb.Stats:
    return pb.Stats(strategy=s.strategy, prompt_tokens=s.prompt_tokens, generated_tokens=s.generated_tokens,
                    steps=s.steps, target_forwards=s.target_forwards, drafter_forwards=s.drafter_forwards,
                    drafted_tokens=s.drafted_tokens, accepted_tokens=s.accepted_tokens,
                    accepted_hist=s.accepted_hist, accepted_per_pos=s.accepted_per_pos, wall_s=s.wall_s,
                    ttft_s=s.ttft_s, tokens_per_s=s.tokens_per_s, mean_accepted=s.mean_accepted,
                    acceptance_rate=s.acceptance_rate)


def result_to_proto(r: GenerationResult) -> pb.GenerateResponse:
    return pb.GenerateResponse(text=r.text, token_ids=r.token_ids, finish_reason=r.finish_reason,
                               stats=stats_to_proto(r.stats), seed=r.seed, request_id=r.request_id)


def _allowed(opt) -> str:
    choices = opt.allowed_choices()
    if choices:
        return "one of " + ", ".join(map(str, choices))
    if opt.low is None and opt.high is None:
        return opt.kind.__name__
    lo = "-inf" if opt.low is None else opt.low
    hi = "inf" if opt.high is None else opt.high
    return f"{'(' if opt.low_open else '['}{lo}, {hi}{')' if opt.high_open else ']'}"


def server_info(coord) -> pb.ServerInfoResponse:
    active = coord.active_requests()
    models = [pb.ModelInfo(name=e.name, role=e.role, placement=e.placement,
                           tp_size=getattr(e.handle, "tp_size", 1), vocab_size=e.handle.vocab_size,
                           max_length=getattr(e.handle, "max_length", 0),
                           num_params=getattr(e.handle, "num_params", 0), active_requests=active.get(e.name, []))
              for e in coord.entries.values()]
    strategies = [pb.StrategyInfo(name=n, help=c.help, lossless=c.lossless,
                                  options=[pb.OptionInfo(name=o.name, type=o.kind.__name__, default=str(o.default),
                                                         allowed=_allowed(o), help=o.help) for o in c.options])
                  for n, c in sorted(REGISTRY.items())]
    live = coord.live_requests()
    cfg = coord.cfg
    return pb.ServerInfoResponse(models=models, strategies=strategies, default_strategy=cfg.engine.strategy,
                                 max_new_tokens_limit=cfg.engine.max_new_tokens_limit,
                                 max_concurrent=coord.max_concurrent, max_queue=coord.max_queue,
                                 live_requests=[x.rid for x in live],
                                 running=sum(x.state == "running" for x in live), ready=coord.ready,
                                 topology=coord.topology, vocab_size=coord.engine.vocab_size,
                                 recent=[pb.RequestSummary(request_id=r, strategy=s, outcome=o, generated_tokens=n)
                                         for r, s, o, n in list(coord.recent)])


def _openai_finish(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


# -- the deployment --------------------------------------------------------------------------------
class _Abort(Exception):
    """Carries a sanitized message to Serve after the gRPC status was set on the context."""


class SpecServeDeployment:
    """A Serve replica: one coordinator (one serving unit). Decorated with ``serve.deployment`` in
    :func:`build_app`."""

    def __init__(self, cfg: Config):
        from .coordinator import Coordinator
        from .metrics import make_metrics
        self.cfg = cfg
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

    # -- gRPC ---------------------------------------------------------------------------------------
    def _fail(self, ctx, exc: BaseException, strategy: str | None):
        if isinstance(exc, ParamError):
            code, msg, outcome = grpc.StatusCode.INVALID_ARGUMENT, str(exc), "invalid"
        elif isinstance(exc, OverloadedError):
            code, msg, outcome = grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "overloaded"
        else:
            log.error("internal error", exc_info=exc)
            code, msg, outcome = grpc.StatusCode.INTERNAL, "internal error (details in the server log)", "error"
        if outcome != "error" and self.coord.metrics is not None:
            self.coord.metrics.record(strategy or self.cfg.engine.strategy, outcome)
        if ctx is not None:
            ctx.set_code(code)
            ctx.set_details(msg)
        raise _Abort(msg) from None

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        try:
            req = request_from_proto(request, self.cfg)
            return result_to_proto(await self.coord.generate(req))
        except asyncio.CancelledError:
            raise
        except Exception as e:                     # noqa: BLE001 - mapped to a status code
            self._fail(grpc_context, e, request.strategy)

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None):
        try:
            req = request_from_proto(request, self.cfg)
            async for chunk in self.coord.stream(req):
                yield pb.GenerateChunk(text=chunk.text, token_ids=chunk.token_ids,
                                       finish_reason=chunk.finish_reason or "",
                                       result=result_to_proto(chunk.result) if chunk.result else None)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:                     # noqa: BLE001
            self._fail(grpc_context, e, request.strategy)

    async def ServerInfo(self, request: pb.ServerInfoRequest, grpc_context=None) -> pb.ServerInfoResponse:
        return await asyncio.to_thread(server_info, self.coord)

    async def Check(self, request, grpc_context=None):
        from grpc_health.v1 import health_pb2
        if request.service not in ("", SERVICE):
            if grpc_context is not None:
                grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
                grpc_context.set_details(f"unknown service {request.service!r} (known: '', {SERVICE})")
            raise _Abort("unknown service")
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
        if path.endswith("/health"):
            return JSONResponse({"ready": self.coord.ready}, status_code=200 if self.coord.ready else 503)
        if path.endswith("/v1/models"):
            return JSONResponse({"object": "list", "data": [{"id": self.cfg.cluster.app_name, "object": "model",
                                                             "owned_by": "specserve"}]})
        if not path.endswith("/v1/completions"):
            return JSONResponse(_oai_error(f"no route {path}", "not_found"), status_code=404)
        if request.method != "POST":
            return JSONResponse(_oai_error("use POST", "invalid_request_error"), status_code=405)
        try:
            try:
                body = json.loads(await request.body())
            except ValueError:
                raise ParamError("body", "a JSON object", "invalid JSON") from None
            req, stream = request_from_openai(body, self.cfg)
            req = self.coord.validate(req)             # fixes request id and seed for every chunk
            if stream:
                return await self._sse(req)
            r = await self.coord.generate(req)
            return JSONResponse(self._completion(r, r.text, r.finish_reason, usage=True))
        except asyncio.CancelledError:
            raise
        except ParamError as e:
            return JSONResponse(_oai_error(str(e), "invalid_request_error", e.name), status_code=400)
        except OverloadedError as e:
            return JSONResponse(_oai_error(str(e), "server_overloaded"), status_code=429)
        except Exception:                          # noqa: BLE001
            log.exception("internal error")
            return JSONResponse(_oai_error("internal error (details in the server log)", "internal_error"),
                                status_code=500)

    async def _sse(self, req: GenerationRequest):
        from starlette.responses import StreamingResponse
        gen = self.coord.stream(req)
        first = await gen.__anext__()              # validation / overload errors surface as HTTP codes

        async def events():
            try:
                chunk = first
                while True:
                    if chunk.text or chunk.finish_reason:
                        payload = self._completion(chunk.result, chunk.text, chunk.finish_reason,
                                                   usage=chunk.result is not None, rid=req.request_id)
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


def _oai_error(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# -- deploying -------------------------------------------------------------------------------------
def build_app(cfg: Config):
    """The bound Serve application for ``cfg`` (one deployment; replicas = serving units)."""
    from ray import serve
    cl = cfg.cluster
    dep = serve.deployment(SpecServeDeployment, name="SpecServe").options(
        num_replicas=cl.replicas,
        ray_actor_options={"num_cpus": cl.coordinator.num_cpus, "num_gpus": cl.coordinator.num_gpus},
        max_ongoing_requests=cl.capacity + 32,     # headroom beyond admission for ServerInfo / health
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
    """Serve application builder (``import_path: cluster.serve_app:app_builder``, ``args: {config: PATH}``):
    what a KubeRay RayService's ``serveConfigV2`` deploys (see k8s/).  The Serve config's
    ``grpc_options`` / ``http_options`` must match the config's ``cluster`` ports."""
    from .config import load_config
    return build_app(load_config(args.get("config", "configs/local.yaml")))
