"""What a load test does, as typed, validated dataclasses: stages (open-loop Poisson arrivals or
closed-loop concurrency) and the request each stage sends.

Stages come from the command line (:func:`parse_stages`: ``"rate=2:30s,c=8:20s:max=100"``) or from a
YAML file (:func:`load_spec`, parsed with ``yaml.safe_load``).  Every refusal is a :class:`ParamError`
that names the parameter by its path (``stages[1].rate``), the allowed range and the value.

    request:                      # defaults for every stage
      protocol: grpc              # grpc (GenerateStream / Generate) | http (POST /v1/completions)
      stream: true
      max_new_tokens: 32
      temperature: 0
      strategy: speculative       # default: the server's
      options: {k: 4}
      ignore_eos: true
      timeout_s: 60               # client-side deadline of one request
    stages:
      - {rate: 2, duration: 30s}                       # Poisson arrivals, 2 requests/s, for 30 s
      - {concurrency: 8, duration: 20s, max_requests: 100, request: {strategy: autoregressive}}
    seed: 0
    max_in_flight: 256            # open loop: an arrival waits while this many requests are outstanding
    retry_after: true             # closed loop: a refused client waits Retry-After before its next request
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.errors import ParamError, check_float, check_int

PROTOCOLS = ("grpc", "http")
ENDPOINTS = ("completions", "chat")      # the prompt as a completion prompt, or as one user message
MAX_DURATION_S = 86400.0
MAX_RATE = 10000.0
MAX_CONCURRENCY = 4096
MAX_REQUESTS = 1_000_000
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(name: str, value: Any) -> float:
    """Seconds from ``30``, ``30s``, ``500ms``, ``2m`` or ``1h``, in (0, 86400]."""
    allowed = f"a duration in (0, {MAX_DURATION_S:g}] s, e.g. 30, 30s, 500ms, 2m"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = _DURATION.match(value) if isinstance(value, str) else None
        if m is None:
            raise ParamError(name, allowed, value)
        seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if not 0 < seconds <= MAX_DURATION_S:
        raise ParamError(name, allowed, value)
    return seconds


@dataclass(frozen=True)
class RequestSpec:
    """The request a stage sends (``None``: the server's default)."""

    protocol: str = "grpc"
    stream: bool = True
    max_new_tokens: int = 32
    temperature: float | None = None
    top_p: float | None = None
    strategy: str | None = None
    options: dict = field(default_factory=dict)
    ignore_eos: bool = False
    seed: int | None = None            # per request: seed + its sequence number (None: random)
    timeout_s: float = 120.0
    endpoint: str = "completions"      # completions, or chat (/v1/chat/completions; gRPC: `messages`)
    model: str | None = None           # HTTP: the OpenAI `model` field (None: not sent; specserve serves one)
    openai: bool = False               # HTTP: plain OpenAI fields only (no strategy, options: any OpenAI server)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Stage:
    """``mode`` "rate": Poisson arrivals at ``value`` requests/s; "concurrency": ``value`` clients, each
    sending its next request when the last one ends.  A stage stops sending after ``duration_s`` or
    ``max_requests`` requests, whichever comes first, then waits for the requests still out."""

    mode: str
    value: float
    duration_s: float
    max_requests: int | None = None
    request: RequestSpec = field(default_factory=RequestSpec)

    @property
    def label(self) -> str:
        return f"rate={self.value:g}/s" if self.mode == "rate" else f"c={int(self.value)}"

    def to_dict(self) -> dict:
        return {"mode": self.mode, "value": self.value, "duration_s": self.duration_s,
                "max_requests": self.max_requests, "label": self.label, "request": self.request.to_dict()}


@dataclass(frozen=True)
class LoadSpec:
    """``retry_after``: a closed-loop client refused with RESOURCE_EXHAUSTED / UNAVAILABLE (HTTP 429 / 503)
    waits the Retry-After delay (1 s for gRPC) before its next request, instead of retrying at once."""

    stages: tuple[Stage, ...]
    seed: int = 0
    max_in_flight: int = 512
    retry_after: bool = True

    def to_dict(self) -> dict:
        return {"stages": [s.to_dict() for s in self.stages], "seed": self.seed, "max_in_flight": self.max_in_flight,
                "retry_after": self.retry_after}

    @property
    def time_bound_s(self) -> float:
        """The longest a run may take: every stage's sending window plus one request deadline to drain."""
        return sum(s.duration_s + s.request.timeout_s for s in self.stages)


def _keys(path: str, data: Any, known: tuple[str, ...]) -> dict:
    if not isinstance(data, dict):
        raise ParamError(path or "spec", "a mapping with keys " + ", ".join(known), data)
    for key in data:
        if key not in known:
            raise ParamError(f"{path}.{key}" if path else str(key), "a known key: " + ", ".join(known), key)
    return data


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    raise ParamError(name, "true or false", value)


def request_spec(data: Any, path: str = "request", base: RequestSpec | None = None) -> RequestSpec:
    """``base`` with the fields in ``data`` replaced, each checked."""
    d = _keys(path, data, tuple(f.name for f in dataclasses.fields(RequestSpec)))
    out, p = {}, lambda k: f"{path}.{k}"
    for k, v in d.items():
        if k == "protocol":
            if v not in PROTOCOLS:
                raise ParamError(p(k), "one of " + ", ".join(PROTOCOLS), v)
            out[k] = v
        elif k in ("stream", "ignore_eos", "openai"):
            out[k] = _bool(p(k), v)
        elif k == "endpoint":
            if v not in ENDPOINTS:
                raise ParamError(p(k), "one of " + ", ".join(ENDPOINTS), v)
            out[k] = v
        elif k == "model":
            if v is not None and not (isinstance(v, str) and 0 < len(v) <= 256 and v.isprintable()):
                raise ParamError(p(k), "a model name (1 to 256 printable characters)", v)
            out[k] = v
        elif k == "max_new_tokens":
            out[k] = check_int(p(k), v, 1, 65536)
        elif k == "temperature":
            out[k] = None if v is None else check_float(p(k), v, 0.0, 100.0)
        elif k == "top_p":
            out[k] = None if v is None else check_float(p(k), v, 0.0, 1.0, low_open=True)
        elif k == "strategy":
            if v is not None and (not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9_]{1,64}", v)):
                raise ParamError(p(k), "a strategy name (letters, digits, _)", v)
            out[k] = v
        elif k == "options":
            if not isinstance(v, dict) or not all(isinstance(x, str) for x in v):
                raise ParamError(p(k), "a mapping of option name to value", v)
            out[k] = {x: str(y) for x, y in v.items()}
        elif k == "seed":
            out[k] = None if v is None else check_int(p(k), v, 0, 2**62)
        elif k == "timeout_s":
            out[k] = check_float(p(k), v, 0.0, 3600.0, low_open=True)
    spec = dataclasses.replace(base or RequestSpec(), **out)
    if spec.openai:                    # a server that is not specserve: neither our protocol nor our fields
        for name, bad in (("protocol", spec.protocol != "http"), ("strategy", spec.strategy is not None),
                          ("options", bool(spec.options))):
            if bad:
                raise ParamError(p(name), "http and no strategy or options with openai: true (plain OpenAI "
                                 "fields, for any OpenAI-compatible server)", getattr(spec, name))
    return spec


def stage_from(data: Any, path: str, base: RequestSpec) -> Stage:
    d = _keys(path, data, ("rate", "concurrency", "c", "duration", "max_requests", "request"))
    modes = [k for k in ("rate", "concurrency", "c") if k in d]
    if len(modes) != 1:
        raise ParamError(path, "exactly one of rate, concurrency", modes or "neither")
    mode = modes[0]
    if mode == "rate":
        value = check_float(f"{path}.rate", d["rate"], 0.0, MAX_RATE, low_open=True)
    else:
        value = float(check_int(f"{path}.{mode}", d[mode], 1, MAX_CONCURRENCY))
    if "duration" not in d:
        raise ParamError(f"{path}.duration", "a duration, e.g. 30s (every stage is bounded in time)", None)
    duration = parse_duration(f"{path}.duration", d["duration"])
    max_requests = d.get("max_requests")
    if max_requests is not None:
        max_requests = check_int(f"{path}.max_requests", max_requests, 1, MAX_REQUESTS)
    req = request_spec(d["request"], f"{path}.request", base) if "request" in d else base
    return Stage("rate" if mode == "rate" else "concurrency", value, duration, max_requests, req)


def spec_from_dict(data: Any, *, overrides: dict | None = None) -> LoadSpec:
    """A :class:`LoadSpec` from a mapping (a YAML file's top level); ``overrides`` (request fields, e.g.
    the CLI's flags) replace the file's request defaults field by field."""
    d = _keys("", data, ("request", "stages", "seed", "max_in_flight", "retry_after"))
    base = request_spec(d.get("request") or {}, "request")
    if overrides:
        base = request_spec(overrides, "request", base)
    stages = d.get("stages")
    if not isinstance(stages, list) or not stages:
        raise ParamError("stages", "a non-empty list of stages", stages)
    return LoadSpec(stages=tuple(stage_from(s, f"stages[{i}]", base) for i, s in enumerate(stages)),
                    seed=check_int("seed", d.get("seed", 0), 0, 2**31 - 1),
                    max_in_flight=check_int("max_in_flight", d.get("max_in_flight", 512), 1, 100_000),
                    retry_after=_bool("retry_after", d.get("retry_after", True)))


def load_spec(path: str | Path, *, overrides: dict | None = None) -> LoadSpec:
    p = Path(path)
    if not p.is_file():
        raise ParamError("spec", "an existing YAML file", str(p))
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ParamError("spec", "valid YAML", f"{p}: {str(e).splitlines()[0]}") from None
    return spec_from_dict(data, overrides=overrides)


def parse_stages(text: str, base: RequestSpec | None = None) -> tuple[Stage, ...]:
    """``"rate=2:30s,c=8:20s:max=100:protocol=http:strategy=autoregressive"``: comma-separated stages,
    each ``MODE=VALUE:DURATION`` then optional ``max=``, ``protocol=``, ``strategy=``, ``tokens=``."""
    base = base or RequestSpec()
    parts = [s.strip() for s in str(text).split(",") if s.strip()]
    if not parts:
        raise ParamError("stages", "comma-separated MODE=VALUE:DURATION, e.g. rate=2:30s,c=8:20s", text)
    out = []
    for i, part in enumerate(parts):
        path = f"stages[{i}]"
        fields = part.split(":")
        if len(fields) < 2 or "=" not in fields[0]:
            raise ParamError(path, "MODE=VALUE:DURATION[:max=N][:protocol=P][:strategy=S][:tokens=N]", part)
        mode, value = fields[0].split("=", 1)
        d: dict[str, Any] = {mode.strip(): value.strip(), "duration": fields[1]}
        req: dict[str, Any] = {}
        for kv in fields[2:]:
            key, _, val = kv.partition("=")
            key = key.strip()
            if key == "max":
                d["max_requests"] = val
            elif key in ("protocol", "strategy"):
                req[key] = val.strip()
            elif key == "tokens":
                req["max_new_tokens"] = val
            else:
                raise ParamError(f"{path}.{key}", "one of max, protocol, strategy, tokens", kv)
        if req:
            d["request"] = req
        out.append(stage_from(d, path, base))
    return tuple(out)


def stages_from_levels(mode: str, levels: str, duration: Any, max_requests: Any,
                       base: RequestSpec | None = None) -> tuple[Stage, ...]:
    """``--concurrency 1,4,16`` / ``--rate 2,8`` with one ``--duration`` (and ``--max-requests``)."""
    values = [v.strip() for v in str(levels).split(",") if v.strip()]
    if not values:
        raise ParamError(mode, "comma-separated values, e.g. 1,4,16", levels)
    extra = {} if max_requests is None else {"max_requests": max_requests}
    return tuple(stage_from({mode: v, "duration": duration, **extra}, f"{mode}[{i}]", base or RequestSpec())
                 for i, v in enumerate(values))
