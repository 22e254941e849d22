"""The Ray Serve application: gRPC ``specserve.v1.SpecServe`` + OpenAI-compatible ``/v1/completions``.

One deployment replica = one serving unit (coordinator + its drafters + its target group, see
:mod:`cluster.serving.coordinator`), so ``cluster.replicas`` scales whole units.  gRPC goes through Serve's
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

import logging

from cluster.config.schema import Config
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest, GenerationResult
from cluster.errors import ParamError, check_int
from cluster.strategies import REGISTRY
from protos import specserve_pb2 as pb

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
                                 max_concurrent=coord.max_batch, max_queue=coord.max_queue,
                                 live_requests=[x.rid for x in live],
                                 running=sum(x.status == "running" for x in live), ready=coord.ready,
                                 topology=coord.topology, vocab_size=coord.engine.vocab_size,
                                 recent=[pb.RequestSummary(request_id=r, strategy=s, outcome=o, generated_tokens=n)
                                         for r, s, o, n in list(coord.recent)])
