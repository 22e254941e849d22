"""The Ray Serve application: gRPC ``specserve.v1.SpecServe`` + OpenAI-compatible completions and chat.

One deployment replica = one serving unit (coordinator + its drafters + its target group, see
:mod:`cluster.serving.control.coordinator`), so ``cluster.replicas`` scales whole units.  gRPC goes through Serve's
gRPC proxy (methods ``Generate``, ``GenerateStream``, ``ServerInfo`` and the standard
``grpc.health.v1.Health/Check``, SERVING only after warm-up); HTTP through Serve's HTTP proxy
(``POST /v1/completions`` and ``/v1/chat/completions`` incl. ``"stream": true`` as server-sent events,
``GET /v1/models``, ``GET /health``).

Errors go through the one table of :mod:`cluster.serving.ops.error_table`: a :class:`cluster.errors.ParamError`
becomes ``INVALID_ARGUMENT`` / HTTP 400 naming field, allowed range and value (truncated, see
:func:`cluster.errors.shown`); :class:`cluster.errors.OverloadedError` becomes ``RESOURCE_EXHAUSTED`` / HTTP
429; anything else ``INTERNAL`` / 500 with a sanitized message (the traceback stays in the server log).
Both fronts build requests through the one request path, :func:`cluster.serving.fronts.requests.admit`.  A refused request is answered without raising through Ray Serve (which
would log a traceback per request); a refused stream carries one empty chunk before its status, because
Serve forwards a status set by a streaming handler only with a message.  A client that cancels or
disconnects stops its generation (see the coordinator); Serve's proxy alone would lose a cancel that arrives
while it is sending a chunk (~1 in 10 streams), so :mod:`protos.guard` wraps its streaming handler to forward
every cancel (tests/serving/test_cancel.py: 0 of 200 lost, 12 of 100 without the wrapper).

Sizes are limited before any expensive work (constants in :mod:`cluster.engine.request`): a message of at
most MAX_MESSAGE_BYTES, checked by the guarded deserializers of :mod:`protos.guard` in Serve's
gRPC proxy before parsing (a message that does not parse becomes ``INVALID_ARGUMENT`` too, not ``UNKNOWN``);
counts of prompt ids, stop strings and options before they are copied; the prompt's characters before
tokenizing (:mod:`cluster.engine.validate`).  Ray's ``gRPCOptions`` has no message-size setting: the proxy's
transport limit is Ray's environment variable ``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE`` (default 2 GiB, read when
the proxy starts), so deployments should also set it on every Ray node, e.g.
``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE=8388608 ray start ...`` or the KubeRay containers' ``env``, to refuse
bigger messages before they are read.
"""
from __future__ import annotations

import json

from cluster.engine.request import (
    MAX_OPTIONS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_IDS,
    MAX_STOP_STRINGS,
    GenerationResult,
)
from cluster.errors import ParamError
from cluster.models.chat_template import MAX_MESSAGES
from cluster.serving.fronts.oai_fields import MAX_TEMPLATE_KWARGS_BYTES, TEMPLATE_KWARGS_ALLOWED, template_kwargs
from cluster.serving.fronts.requests import Fields
from cluster.serving.fronts.structured import Structured, structured, tool_call_objects
from cluster.strategies import REGISTRY
from protos import specserve_pb2 as pb
from protos.guard import MalformedRequest


SERVICE = "specserve.v1.SpecServe"


def malformed_error(m: MalformedRequest) -> ParamError:
    return ParamError("request", m.allowed, m.value)


# -- requests --------------------------------------------------------------------------------------
def fields_from_proto(m: pb.GenerateRequest) -> Fields:
    """The request's fields (:mod:`cluster.serving.fronts.requests` merges the defaults and validates); unset
    optional fields stay None.  Counts and lengths are checked before anything is copied (a refused message
    arrives as a MalformedRequest)."""
    if isinstance(m, MalformedRequest):
        raise malformed_error(m)
    for name, n, cap, what in (("prompt_ids", len(m.prompt_ids), MAX_PROMPT_IDS, "token ids"),
                               ("prompt", len(m.prompt), MAX_PROMPT_CHARS, "characters"),
                               ("prediction", len(m.prediction), MAX_PROMPT_CHARS, "characters"),
                               ("resume_token_ids", len(m.resume_token_ids), MAX_PROMPT_IDS, "token ids"),
                               ("stop", len(m.stop), MAX_STOP_STRINGS, "strings"),
                               ("options", len(m.options), MAX_OPTIONS, "options"),
                               ("messages", len(m.messages), MAX_MESSAGES, "messages")):
        if n > cap:
            raise ParamError(name, f"at most {cap} {what}", f"{n} {what}")
    opt = {name: getattr(m, name) if m.HasField(name) else None for name in OPTIONAL}
    messages = [_message(x) for x in m.messages] or None
    choice = m.tool_choice if m.tool_choice in ("", "none", "auto", "required") else \
        {"type": "function", "function": {"name": m.tool_choice}}
    spec = structured(_json("tools", m.tools_json), choice or None,
                      m.parallel_tool_calls if m.HasField("parallel_tool_calls") else None,
                      _json("response_format", m.response_format_json))
    return Fields(prompt=m.prompt or None, prompt_ids=list(m.prompt_ids) or None, messages=messages,
                  stop=tuple(m.stop), strategy=m.strategy or None, options=dict(m.options),
                  ignore_eos=m.ignore_eos, request_id=m.request_id or None,
                  resume_ids=list(m.resume_token_ids) or None,
                  template_kwargs=template_kwargs_json(m.chat_template_kwargs), structured=spec, **opt)


def _message(x: pb.ChatMessage) -> dict:
    """A chat message as OpenAI's JSON shape (what cluster.models.chat_template checks)."""
    out = {"role": x.role, "content": x.content}
    out.update({k: getattr(x, k) for k in ("name", "tool_call_id") if getattr(x, k)})
    if x.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in x.tool_calls]
    return out


def _json(name: str, text: str, allowed: str = "JSON text"):
    """A JSON-text field (None when empty); ``allowed`` is what the error says the field takes."""
    try:
        return json.loads(text) if text else None
    except ValueError:
        raise ParamError(name, allowed, text) from None


OPTIONAL = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "prompt_logprobs", "prediction",
            "cache_salt")


def template_kwargs_json(text: str) -> dict | None:
    """``chat_template_kwargs`` from its JSON text ("" = none)."""
    if len(text) > MAX_TEMPLATE_KWARGS_BYTES:
        raise ParamError("chat_template_kwargs", TEMPLATE_KWARGS_ALLOWED, f"{len(text)} characters")
    return template_kwargs(_json("chat_template_kwargs", text, "a JSON object: " + TEMPLATE_KWARGS_ALLOWED))


# -- responses -------------------------------------------------------------------------------------
def stats_to_proto(s) -> pb.Stats:
    return pb.Stats(strategy=s.strategy, prompt_tokens=s.prompt_tokens, cached_tokens=s.cached_tokens,
                    generated_tokens=s.generated_tokens,
                    steps=s.steps, target_forwards=s.target_forwards, drafter_forwards=s.drafter_forwards,
                    drafted_tokens=s.drafted_tokens, accepted_tokens=s.accepted_tokens,
                    accepted_hist=s.accepted_hist, accepted_per_pos=s.accepted_per_pos, wall_s=s.wall_s,
                    ttft_s=s.ttft_s, tokens_per_s=s.tokens_per_s, mean_accepted=s.mean_accepted,
                    acceptance_rate=s.acceptance_rate, prediction_drafted=s.prediction_drafted,
                    prediction_accepted=s.prediction_accepted)


def logprobs_to_proto(entries) -> list[pb.TokenLogprob]:
    """Token logprobs as messages (None entries, the first prompt token's, left out)."""
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                            top_logprobs=[v for _, v in lp.top]) for lp in entries or () if lp is not None]


def result_to_proto(r: GenerationResult, spec: Structured | None = None) -> pb.GenerateResponse:
    """The response; with tools (``spec`` reads calls) the calls read from the output and its content."""
    content, calls = spec.fmt.parse(r.text) if spec is not None and spec.reads_calls else (r.text, [])
    return pb.GenerateResponse(text=r.text, token_ids=r.token_ids, finish_reason=r.finish_reason,
                               stats=stats_to_proto(r.stats), seed=r.seed, request_id=r.request_id,
                               logprobs=logprobs_to_proto(r.logprobs),
                               prompt_logprobs=logprobs_to_proto(r.prompt_logprobs), content=content or "",
                               tool_calls=[pb.ToolCall(id=c["id"], name=c["function"]["name"],
                                                       arguments=c["function"]["arguments"])
                                           for c in tool_call_objects(calls)])


def chunk_to_proto(chunk, spec: Structured | None = None) -> pb.GenerateChunk:
    return pb.GenerateChunk(text=chunk.text, token_ids=chunk.token_ids, finish_reason=chunk.finish_reason or "",
                            result=result_to_proto(chunk.result, spec) if chunk.result else None,
                            logprobs=logprobs_to_proto(chunk.logprobs))


def _allowed(opt) -> str:
    choices = opt.allowed_choices()
    if choices:
        return "one of " + ", ".join(map(str, choices))
    if opt.low is None and opt.high is None:
        return opt.kind.__name__
    lo = "-inf" if opt.low is None else opt.low
    hi = "inf" if opt.high is None else opt.high
    return f"{'(' if opt.low_open else '['}{lo}, {hi}{')' if opt.high_open else ']'}"


def server_info(coord, *, request_ids: bool = True) -> pb.ServerInfoResponse:
    """The server's description; ``request_ids=False`` (a caller without the operator key when auth is on)
    leaves out other clients' request ids: per-model active requests, live and recent requests."""
    active = coord.active_requests() if request_ids else {}
    cache = coord.cache_info()
    models = [pb.ModelInfo(name=e.name, role=e.role, placement=e.placement,
                           tp_size=getattr(e.handle, "tp_size", 1), vocab_size=e.handle.vocab_size,
                           max_length=getattr(e.handle, "max_length", 0),
                           num_params=getattr(e.handle, "num_params", 0), active_requests=active.get(e.name, []),
                           prefix_cache_tokens=cache.get(e.name, {}).get("tokens", 0),
                           prefix_cache_slots=cache.get(e.name, {}).get("slots", 0))
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
                                 live_requests=[x.rid for x in live] if request_ids else [],
                                 running=sum(x.status == "running" for x in live), ready=coord.ready,
                                 topology=coord.topology, vocab_size=coord.engine.vocab_size,
                                 recent=[pb.RequestSummary(request_id=r, strategy=s, outcome=o, generated_tokens=n)
                                         for r, s, o, n in (list(coord.recent) if request_ids else [])],
                                 prefix_cache_queries=coord.cache_tokens[0], prefix_cache_hits=coord.cache_tokens[1])
