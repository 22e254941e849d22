"""Fuzzing the served cluster through its real gRPC and HTTP ports, plus the request-size and head rules.

Property-based (hypothesis, seeded and derandomized): generated requests mix valid and invalid fields (wrong
types, huge / negative / NaN / subnormal numbers, unicode incl. lone surrogates in HTTP JSON, deep nesting,
unknown strategies and options, prompts up to a few MB, undecodable and oversized gRPC messages).  Every
answer must be OK / INVALID_ARGUMENT / RESOURCE_EXHAUSTED (HTTP 200 / 400 / 404 / 429) with a short error
text free of tracebacks, file paths, pids and addresses; afterwards the server still serves and no request
state remains on any actor.

CI runs SPECSERVE_FUZZ_EXAMPLES=400 requests by default (45% gRPC, 45% HTTP, 10% raw gRPC bytes).  At scale
(>= 10,000 requests; about 6 minutes on 2 cores), with the counts by status printed at the end:

    SPECSERVE_FUZZ_EXAMPLES=10000 python -m pytest -q -s -p no:cacheprovider tests/serving/test_fuzz.py -m fuzz
"""
from __future__ import annotations

import collections
import copy
import json
import math
import os
import re
import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from cluster.config.schema import load_config
from cluster.core.sampling import SamplingParams
from cluster.engine.request import (
    MAX_MESSAGE_BYTES,
    MAX_OPTION_VALUE,
    MAX_PROMPT_CHARS,
    MAX_STOP_STRINGS,
    MIN_TEMPERATURE,
    GenerationRequest,
)
from cluster.engine.validate import prepare
from cluster.errors import ParamError, check_float, check_int, shown
from cluster.strategies import REGISTRY, all_options, resolve_options
from protos import specserve_pb2 as pb

TOTAL = int(os.environ.get("SPECSERVE_FUZZ_EXAMPLES", "400"))
GRPC_N, HTTP_N = max(1, TOTAL * 45 // 100), max(1, TOTAL * 45 // 100)
RAW_N = max(1, TOTAL - GRPC_N - HTTP_N)
SEED = 20261122
FUZZ = dict(derandomize=True, deadline=None, database=None, print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                   HealthCheck.large_base_example])
TIMEOUT_S = 120

GRPC_OK = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
HTTP_OK = {200, 400, 404, 429}
LEAKS = re.compile(r"Traceback|File \"|pid=|/work|site-packages|\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}\b")
MAX_DETAILS = 1024
TALLY: collections.Counter = collections.Counter()


def _clean(text: str) -> bool:
    """Generated text that could not be mistaken for a leak when the server echoes it back."""
    return not LEAKS.search(text)


# -- generators --------------------------------------------------------------------------------------
OPTION_NAMES = sorted(all_options())
INT64 = st.integers(-2**63, 2**63 - 1)
ODD_FLOATS = st.sampled_from([0.0, -0.0, 5e-324, 5e-309, 2.2e-308, 1e-300, 1e-5, MIN_TEMPERATURE, 0.5, 1.0, 100.0,
                              100.0001, 1e308, math.inf, -math.inf, math.nan, -1.0])
FLOATS = st.one_of(ODD_FLOATS, st.floats(allow_nan=True, allow_infinity=True))
BIG = st.sampled_from([1_100, 33_000, MAX_PROMPT_CHARS + 1, 3_000_000])          # huge prompts: a few MB at most


def _text(max_size: int, surrogates: bool = False):
    chars = st.characters() if surrogates else st.characters(blacklist_categories=("Cs",))
    return st.text(chars, max_size=max_size).filter(_clean)


def _strategy_name(surrogates: bool = False):
    return st.one_of(st.sampled_from(sorted(REGISTRY)), st.just(""), _text(20, surrogates),
                     st.sampled_from(["né", "\u202especulative", "speculative ", "SPECULATIVE", "x" * 5000]))


def _option_value(surrogates: bool = False):
    return st.one_of(
        st.sampled_from(["4", "1", "0", "-1", "65", "1e400", "nan", "inf", "", "drafter-large", "drafter-small", "mag",
                         "target", "/etc/passwd", "../../configs/tiny.yaml", "~", "token", "block", "2,10;0,10",
                         "2,1,3;0,2,4;0,0,5", "[[2,10],[0,10]]", "[" * 200 + "]" * 200, "[" * 5000,
                         "x" * (MAX_OPTION_VALUE + 1), "9" * 5000, "0.5", "²", "1" * 300]),
        _text(40, surrogates))


def _options(surrogates: bool = False):
    keys = st.one_of(st.sampled_from(OPTION_NAMES), _text(12, surrogates), st.just("x" * 100))
    return st.dictionaries(keys, _option_value(surrogates), max_size=4) | st.just({f"o{i}": "1" for i in range(20)})


def _prompt_ids():
    return st.one_of(st.lists(st.integers(0, 256), min_size=1, max_size=40),
                     st.lists(INT64, max_size=8),
                     st.sampled_from([1_017, 1_100, 300_000]).map(lambda n: [7] * n))


VALID_OPTIONS = st.sampled_from([{}, {}, {"k": "1"}, {"k": "64"}, {"drafter": "drafter-small"}, {"verify": "block"},
                                 {"drafter": "drafter-large", "k": "3", "verify": "token"}])


@st.composite
def valid_fields(draw) -> dict:
    """A request that should be served (ids or text, 1-4 new tokens, odd but valid sampling settings)."""
    f = {"prompt_ids": draw(st.lists(st.integers(0, 255), min_size=1, max_size=40))} if draw(st.booleans()) else \
        {"prompt": draw(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=60).filter(_clean))}
    f["max_new_tokens"] = draw(st.integers(1, 4))
    for name, values in (("temperature", st.one_of(st.sampled_from([0.0, MIN_TEMPERATURE, 0.7, 100.0]),
                                                   st.floats(MIN_TEMPERATURE, 100.0))),
                         ("top_p", st.floats(0.0, 1.0, exclude_min=True)), ("top_k", st.integers(0, 2**63 - 1)),
                         ("seed", st.integers(0, 2**63 - 1)),
                         ("stop", st.lists(_text(64).filter(bool), max_size=MAX_STOP_STRINGS)),
                         ("ignore_eos", st.booleans()), ("request_id", st.sampled_from(["fuzz-a", "fuzz b", "ß"]))):
        if draw(st.booleans()):
            f[name] = draw(values)
    if draw(st.booleans()):
        f["strategy"] = draw(st.sampled_from(["speculative", "autoregressive"]))
        f["options"] = draw(VALID_OPTIONS) if f["strategy"] == "speculative" else {}
    return f


@st.composite
def random_fields(draw) -> dict:
    """Every field from a wide range: wrong, huge, negative, NaN, subnormal, unknown, oversized."""
    f: dict = {}
    which = draw(st.sampled_from(["text", "ids", "both", "none", "big"]))
    if which in ("text", "both"):
        f["prompt"] = draw(_text(60))
    if which in ("ids", "both"):
        f["prompt_ids"] = draw(_prompt_ids())
    if which == "big":
        f["prompt"] = "x" * draw(BIG)
    f["max_new_tokens"] = draw(st.one_of(st.integers(1, 4), st.sampled_from([0, -1, 513, 2**31, 2**63 - 1]), INT64))
    for name, values in (("temperature", FLOATS), ("top_p", FLOATS), ("top_k", INT64), ("seed", INT64)):
        if draw(st.booleans()):
            f[name] = draw(values)
    f["stop"] = draw(st.lists(st.one_of(_text(70), st.just("x" * 65)), max_size=MAX_STOP_STRINGS + 2))
    f["strategy"] = draw(_strategy_name())
    f["options"] = draw(_options())
    f["ignore_eos"] = draw(st.booleans())
    f["request_id"] = draw(st.one_of(st.just(""), _text(20), st.sampled_from(["fuzz\n", "x" * 129, "fuzz-1"])))
    if draw(st.booleans()):                      # predicted outputs (issue 33): empty, text, too long
        f["prediction"] = draw(st.one_of(_text(40), st.sampled_from(["", "x" * 40_000])))
    if draw(st.booleans()):                      # chat template variables: JSON text or not
        f["chat_template_kwargs"] = draw(st.one_of(_text(30), st.sampled_from(
            ['{"enable_thinking": false}', "{", "[1]", '{"messages": 1}', "{}"])))
    return f


@st.composite
def grpc_requests(draw):
    """(message, stream?): a valid request, a valid one with one field from the wide range, or all wide."""
    mode = draw(st.sampled_from(["valid", "mutated", "mutated", "random", "random"]))
    f = draw(random_fields()) if mode == "random" else draw(valid_fields())
    if mode == "mutated":
        wide = draw(random_fields())
        key = draw(st.sampled_from(sorted(wide)))
        f[key] = wide[key]
        if key in ("prompt", "prompt_ids"):
            f.pop("prompt_ids" if key == "prompt" else "prompt", None)
    m = pb.GenerateRequest()
    for name, value in f.items():
        if name in ("prompt_ids", "stop"):
            getattr(m, name).extend(value)
        elif name == "options":
            for k, v in value.items():
                m.options[k] = v
        else:
            setattr(m, name, value)
    return m, draw(st.booleans())


def _json_values():
    scalars = st.one_of(st.none(), st.booleans(), INT64, st.integers(), FLOATS, _text(20, surrogates=True))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(_text(8), inner, max_size=4), max_leaves=12)


def _nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


def _http_valid(f: dict) -> dict:
    """An OpenAI completions body from valid fields."""
    body = {"prompt": f.get("prompt", f.get("prompt_ids")), "max_tokens": f["max_new_tokens"]}
    for name in ("temperature", "top_p", "top_k", "seed", "stop", "strategy", "options", "ignore_eos"):
        if name in f:
            body[name] = f[name]
    return body


@st.composite
def _http_wide(draw) -> dict:
    """A body whose fields come from the wide range (JSON types the proto cannot carry included)."""
    body: dict = {}
    prompt = draw(st.sampled_from(["text", "ids", "list1", "odd", "big", "none"]))
    if prompt == "text":
        body["prompt"] = draw(_text(60, surrogates=True))
    elif prompt == "ids":
        body["prompt"] = draw(_prompt_ids())
    elif prompt == "list1":
        body["prompt"] = [draw(_text(30, surrogates=True))]
    elif prompt == "odd":
        body["prompt"] = draw(_json_values())
    elif prompt == "big":
        body["prompt"] = "x" * draw(BIG)
    body["max_tokens"] = draw(st.one_of(st.integers(1, 4), st.sampled_from([0, -5, 513, 10**30, 2.0, 1e300, "3", "²"]),
                                        _json_values()))
    ints = st.one_of(INT64, st.integers())
    stops = st.one_of(_text(10, surrogates=True), st.lists(_text(70, surrogates=True), max_size=10))
    for key, values in (("temperature", st.one_of(FLOATS, st.integers(), st.sampled_from(["0.5", "1e-320", "nan"]))),
                        ("top_p", FLOATS), ("top_k", ints), ("seed", ints), ("stop", stops),
                        ("strategy", st.one_of(_strategy_name(surrogates=True), _json_values())),
                        ("options", st.one_of(_options(surrogates=True), _json_values(),
                                              st.just({"kmatrix": [[2, 10], [0, 10]]}))),
                        ("stream", st.one_of(st.booleans(), _json_values())),
                        ("n", st.sampled_from([1, 2])), ("echo", st.booleans()), ("ignore_eos", st.booleans()),
                        ("extra", _json_values()),
                        ("prediction", st.one_of(_json_values(), st.builds(
                            lambda c: {"type": "content", "content": c}, _json_values()))),
                        ("chat_template_kwargs", _json_values())):
        if draw(st.integers(0, 2)) == 0:
            body[key] = draw(values)
    return body


@st.composite
def http_bodies(draw):
    """(path, raw body bytes)."""
    path = draw(st.sampled_from(["/v1/completions"] * 14 + ["/v1/chat/completions"] * 4 + ["/v1/completion", "/nope"]))
    kind = draw(st.sampled_from(["object"] * 8 + ["nested", "raw", "scalar"]))
    if kind == "raw":
        return path, draw(st.one_of(st.binary(max_size=64), st.sampled_from(
            [b"", b"{", b"\xff\xfe", b'{"prompt": "\xff"}', b'{"prompt": "a"', b"nul\x00l", b"[" * 100_000])))
    if kind == "scalar":
        return path, json.dumps(draw(_json_values())).encode()
    if kind == "nested":
        depth = draw(st.sampled_from([3, 31, 33, 200, 5_000, 200_000]))
        field = draw(st.sampled_from(["prompt", "options", "stop", "seed"]))
        value = _nested(depth) if field != "options" else '{"kmatrix": ' + _nested(depth) + "}"
        return path, ('{"prompt": "hi", "max_tokens": 2, "%s": %s}' % (field, value)).encode()
    body = _http_valid(draw(valid_fields())) if kind == "object" and draw(st.booleans()) else {}
    if body and draw(st.booleans()):
        body["stream"] = draw(st.booleans())
        return path, json.dumps(_as_chat(draw, path, body)).encode()    # valid as drawn
    if body:                                                   # one field from the wide range
        wide = draw(_http_wide())
        key = draw(st.sampled_from(sorted(wide)))
        body[key] = wide[key]
    else:
        body = draw(_http_wide())
    return path, json.dumps(_as_chat(draw, path, body)).encode()     # json.dumps escapes lone surrogates


def _as_chat(draw, path: str, body):
    """For the chat route, mostly: the body's prompt as a message (of a role drawn, an unknown one included)."""
    if path.endswith("/chat/completions") and isinstance(body, dict) and "prompt" in body and \
            draw(st.integers(0, 3)) > 0:
        role = draw(st.sampled_from(["user", "system", "bot"]))
        body["messages"] = [{"role": role, "content": body.pop("prompt")}]
        if "max_tokens" in body and draw(st.booleans()):
            body["max_completion_tokens"] = body.pop("max_tokens")
    return body


# -- checks ------------------------------------------------------------------------------------------
def _check_text(text: str, what: str) -> None:
    assert len(text) <= MAX_DETAILS, (what, len(text), text[:300])
    assert not LEAKS.search(text), (what, text)


def _grpc_call(c, m: pb.GenerateRequest, stream: bool) -> grpc.StatusCode:
    try:
        if stream:
            chunks = list(c.stub.GenerateStream(m, metadata=c.metadata, timeout=TIMEOUT_S))
            assert chunks and chunks[-1].finish_reason in ("length", "eos", "stop"), chunks[-1:]
        else:
            r = c.stub.Generate(m, metadata=c.metadata, timeout=TIMEOUT_S)
            assert r.finish_reason in ("length", "eos", "stop") and r.stats.strategy in REGISTRY
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        _check_text(e.details() or "", f"grpc {e.code()}")
        return e.code()


def _http_call(cfg, path: str, data: bytes) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{cfg.cluster.http_port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _active(c) -> dict[str, set]:
    info = c.server_info()
    return {"live": set(info.live_requests), **{m.name: set(m.active_requests) for m in info.models}}


def _still_serving_and_clean(c) -> None:
    assert c.generate(prompt="def f():", max_new_tokens=4, temperature=0.0, seed=1).finish_reason
    deadline = time.monotonic() + 60
    while any(_active(c).values()):
        assert time.monotonic() < deadline, f"request state left on the actors: {_active(c)}"
        time.sleep(0.05)


# -- through the ports ---------------------------------------------------------------------------------
@pytest.mark.fuzz
def test_fuzz_grpc(served):
    _, c = served

    @seed(SEED)
    @settings(max_examples=GRPC_N, **FUZZ)
    @given(grpc_requests())
    def run(case):
        m, stream = case
        code = _grpc_call(c, m, stream)
        TALLY[f"grpc {code.name}"] += 1
        assert code in GRPC_OK, code

    run()
    _still_serving_and_clean(c)


@pytest.mark.fuzz
def test_fuzz_grpc_raw_bytes(served):
    """Undecodable, truncated, oversized and random bytes as GenerateRequest / Check messages."""
    _, c = served
    valid = pb.GenerateRequest(prompt="hi", max_new_tokens=2).SerializeToString()
    methods = {"/specserve.v1.SpecServe/Generate": "unary", "/specserve.v1.SpecServe/GenerateStream": "stream",
               "/grpc.health.v1.Health/Check": "unary"}
    health_ok = GRPC_OK | {grpc.StatusCode.NOT_FOUND}          # bytes that parse as an unknown service name

    @seed(SEED)
    @settings(max_examples=RAW_N, **FUZZ)
    @given(st.sampled_from(sorted(methods)), st.one_of(
        st.binary(max_size=200), st.just(valid), st.integers(1, len(valid) - 1).map(lambda n: valid[:n]),
        st.binary(min_size=1, max_size=4).map(lambda b: valid + b), st.just(b"\x0a\xff\xff\xff\xff\x0f"),
        st.just(b"\x0a\x05\xff\xfe\xfd\xfc\xfb"), st.just(b"\x0a" + b"\x80\x80\x80\x04" + b"x" * (1 << 23))))
    def run(method, data):
        kind = methods[method]
        call = (c.channel.unary_stream if kind == "stream" else c.channel.unary_unary)(
            method, request_serializer=None, response_deserializer=None)
        try:
            out = call(data, metadata=c.metadata, timeout=TIMEOUT_S)
            if kind == "stream":
                list(out)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            _check_text(e.details() or "", f"raw {e.code()}")
            code = e.code()
        TALLY[f"grpc-raw {code.name}"] += 1
        assert code in (health_ok if "Health" in method else GRPC_OK), code

    run()
    _still_serving_and_clean(c)


@pytest.mark.fuzz
def test_fuzz_http(served):
    cfg, c = served

    @seed(SEED)
    @settings(max_examples=HTTP_N, **FUZZ)
    @given(http_bodies())
    def run(case):
        path, data = case
        status, text = _http_call(cfg, path, data)
        TALLY[f"http {status}"] += 1
        assert status in HTTP_OK, (status, text[:500])
        if status == 200:
            assert text.startswith("{") or "data: [DONE]" in text, text[:300]
        else:
            _check_text(text, f"http {status}")
            err = json.loads(text)["error"]
            assert err["message"] and (status != 400 or err["param"]), err

    run()
    _still_serving_and_clean(c)


@pytest.mark.fuzz
def test_fuzz_named_cases(served):
    """The probe's findings, one by one, on both fronts."""
    cfg, c = served
    grpc_cases = [  # (request kwargs, words the details must contain)
        (dict(prompt="hi", max_new_tokens=2, strategy="né"), ["strategy", "one of", "'né'"]),
        (dict(prompt="hi", max_new_tokens=2, temperature=5e-309), ["temperature", str(MIN_TEMPERATURE), "5e-309"]),
        (dict(prompt="hi", max_new_tokens=2, strategy="specdec_pp", options={"head": "/etc/passwd"}),
         ["head", "drafter-large", "/etc/passwd"]),
        (dict(prompt="hi", max_new_tokens=2, strategy="cs_drafting", options={"kmatrix": "[" * 5000}),
         ["kmatrix", f"0 to {MAX_OPTION_VALUE} characters"]),
        (dict(prompt="x" * 3_000_000, max_new_tokens=2), ["prompt", "characters", "3000000 characters"]),
        (dict(prompt="x" * 40_000, max_new_tokens=2), ["prompt", "32768 characters", "40000 characters"]),
        (dict(prompt_ids=[1] * 300_000, max_new_tokens=2), ["prompt", "at most 1022 tokens", "300000 tokens"]),
        (dict(prompt="hi", max_new_tokens=2, stop=["a"] * 9), ["stop", f"at most {MAX_STOP_STRINGS}", "9"]),
        (dict(prompt="hi", max_new_tokens=2, request_id="r" * 129), ["request_id", "1 to 128", "rrr"]),
        (dict(prompt="hi", max_new_tokens=2, prediction=""), ["prediction", "1 to"]),
        (dict(prompt="hi", max_new_tokens=2, prediction="x" * 40_000), ["prediction", "40000 characters"]),
        (dict(messages=[{"role": "user", "content": "hi"}], max_new_tokens=2,
              chat_template_kwargs={"add_generation_prompt": False}), ["chat_template_kwargs", "add_generation_prompt"]),
        (dict(prompt="hi", max_new_tokens=2, chat_template_kwargs={"k": 1}), ["chat_template_kwargs", "messages"]),
    ]
    for kw, words in grpc_cases:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(**kw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        for w in words:
            assert w in e.value.details(), (w, e.value.details())
        _check_text(e.value.details(), "named")
    big = c.channel.unary_unary("/specserve.v1.SpecServe/Generate", request_serializer=None,
                                response_deserializer=None)
    with pytest.raises(grpc.RpcError) as e:
        big(b"\x0a\x80\x80\x80\x05" + b"x" * (10 << 20), metadata=c.metadata, timeout=TIMEOUT_S)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and str(MAX_MESSAGE_BYTES) in e.value.details()
    http_cases = [  # (raw body, param, words)
        (b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt", ["lone surrogate", "\\\\ud800"]),
        (b'{"prompt": ' + _nested(100_000).encode() + b"}", "body", ["nested at most"]),
        (b'{"prompt": "hi", "options": {"kmatrix": ' + _nested(3_000).encode() + b"}}", "body", ["nested"]),
        (b'{"prompt": "hi", "strategy": "cs_drafting", "options": {"kmatrix": ' + _nested(20).encode() + b"}}",
         "kmatrix", ["rows of numbers"]),
        (b'{"prompt": "hi", "max_tokens": 2, "seed": "\xc2\xb2"}', "seed", ["integer"]),
        (b'{"prompt": "hi", "max_tokens": 2, "temperature": 1' + b"0" * 400 + b"}", "temperature", ["number"]),
        (json.dumps({"prompt": "x" * (MAX_MESSAGE_BYTES + 1)}).encode(), "body", [str(MAX_MESSAGE_BYTES)]),
        (b'{"prompt": "hi", "max_tokens": 2, "prediction": {"type": "content", "content": 3}}', "prediction",
         ["type", "content"]),
        (b'{"prompt": "hi", "max_tokens": 2, "prediction": "hi"}', "prediction", ["content"]),
        (b'{"prompt": "hi", "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": false}}',
         "chat_template_kwargs", ["not supported"]),
    ]
    for data, param, words in http_cases:
        status, text = _http_call(cfg, "/v1/completions", data)
        err = json.loads(text)["error"]
        assert status == 400 and err["param"] == param, (status, text[:300])
        for w in words:
            assert w in text, (w, text[:300])
        _check_text(text, "named http")
    _still_serving_and_clean(c)


@pytest.mark.fuzz
def test_fuzz_tally(served):
    """Prints the outcomes by status of this session's fuzz requests (``pytest -s``)."""
    print("\nfuzz outcomes:", dict(sorted(TALLY.items())), "total", sum(TALLY.values()))


# -- units: size checks and the head rule (no cluster) ------------------------------------------------
def test_shown_is_bounded_for_any_value():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    for value in (deep, "x" * 10**7, b"\xff" * 10**6, 10**5000, {"a": [[[[1]]]]}, "\ud800", float("nan")):
        text = shown(value)
        assert len(text) <= 80 and text.isprintable(), text
    assert "\\ud800" in shown("\ud800") and "integer of" in shown(-10**5000)
    assert len(str(ParamError("prompt", "text", "y" * 10**6))) < 200


def test_number_checks_never_raise_other_errors():
    for bad in ("²", "9" * 5000, "-", " "):
        with pytest.raises(ParamError):
            check_int("seed", bad, 0)
    with pytest.raises(ParamError):
        check_float("temperature", 10**400, 0.0, 100.0)


class _CountingTokenizer:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def encode(self, text):
        self.calls += 1
        return self.inner.encode(text)


class _NoCopy(list):
    """Token ids that fail if anything iterates them (a size check must come first)."""

    def __iter__(self):
        raise AssertionError("prompt ids were read before their count was checked")


def _prepare(engine, tokenizer=None, **kw):
    req = GenerationRequest(**{"max_new_tokens": 2, "sampling": SamplingParams(0.0), **kw})
    return prepare(req, engine.models, tokenizer or engine.tokenizer, engine.target,
                   default_strategy="speculative", defaults={}, max_new_tokens_limit=512,
                   vocab_size=engine.vocab_size)


@pytest.mark.parametrize("kw,name,words", [
    (dict(prompt="x" * (MAX_PROMPT_CHARS + 5)), "prompt", ["characters", str(MAX_PROMPT_CHARS + 5)]),
    (dict(prompt="x" * 40_000), "prompt", ["at most 32768 characters", "model length 1024"]),
    (dict(prompt_ids=_NoCopy([3] * 1_023)), "prompt", ["at most 1022 tokens", "1023 tokens"]),
    (dict(prompt="a\ud800"), "prompt", ["lone surrogate"]),
    (dict(prompt="hi", stop=("a",) * (MAX_STOP_STRINGS + 1)), "stop", [f"at most {MAX_STOP_STRINGS} strings"]),
    (dict(prompt="hi", stop=("\udfff",)), "stop", ["lone surrogate"]),
    (dict(prompt="hi", request_id="r" * 129), "request_id", ["1 to 128"]),
    (dict(prompt="hi", sampling=SamplingParams(5e-309)), "temperature", [str(MIN_TEMPERATURE), "5e-309"]),
    (dict(prompt="hi", options={"k": "9" * (MAX_OPTION_VALUE + 1)}), "k", [f"0 to {MAX_OPTION_VALUE} characters"]),
    (dict(prompt="hi", options={f"o{i}": 1 for i in range(17)}), "options", ["at most 16 options"]),
    (dict(prompt="hi", options={"bogus": "1"}), "option", ["speculative", "bogus"]),
    (dict(prompt="hi", strategy="cs_drafting", options={"kmatrix": [[[1]]]}), "kmatrix", ["rows of numbers"]),
    (dict(prompt="hi", strategy=["speculative"]), "strategy", ["one of"]),
])
def test_sizes_refused_before_tokenizing(tiny_engine, kw, name, words):
    tok = _CountingTokenizer(tiny_engine.tokenizer)
    with pytest.raises(ParamError) as e:
        _prepare(tiny_engine, tok, **kw)
    assert e.value.name == name, str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert tok.calls == 0 and len(str(e.value)) < 400


def test_smallest_temperature_is_served(tiny_engine):
    assert _prepare(tiny_engine, prompt="hi", sampling=SamplingParams(MIN_TEMPERATURE)).sampling.temperature > 0
    out = tiny_engine.generate(GenerationRequest(prompt="hi", max_new_tokens=4, seed=0, ignore_eos=True,
                                                 sampling=SamplingParams(MIN_TEMPERATURE)))
    assert len(out.token_ids) == 4


def _with_head(handle, head):
    """The drafter handle carrying a built acceptance head (as the builder sets ``specdec_head``): a shallow
    copy sharing the model and its requests."""
    out = copy.copy(handle)
    out.specdec_head = head
    return out


@pytest.fixture
def head_models(tiny_engine, tmp_path):
    from cluster.models.head import AcceptanceHead, save_head
    torch.manual_seed(0)
    hidden = tiny_engine.models["drafter-large"].model.config.hidden_size
    head_dir = save_head(AcceptanceHead(hidden, depth=1).eval(), tmp_path / "head")
    models = dict(tiny_engine.models)
    models["drafter-large"] = _with_head(models["drafter-large"], str(head_dir))
    return models, str(head_dir)


def test_specdec_head_chosen_by_drafter_name(tiny_engine, head_models):
    models, head_dir = head_models
    build = REGISTRY["specdec_pp"]
    for options in ({"head": "drafter-large"}, {"drafter": "drafter-large"}, {}):
        opts = resolve_options("specdec_pp", options, {"drafter": "drafter-large"})
        assert build(opts, models, "target").head == head_dir               # the served drafter's own head
    opts = resolve_options("specdec_pp", {"head": "drafter-large"}, {})
    assert build(opts, models, "target").drafter == "drafter-large"         # naming the head picks its drafter
    for options, words in (({"drafter": "drafter-small"}, ["drafter-small", "built", "drafter-large"]),
                           ({"drafter": "drafter-large", "head": "drafter-small"}, ["per drafter", "drafter-small"]),
                           ({"head": "target"}, ["head", "target"])):
        with pytest.raises(ParamError) as e:
            build(resolve_options("specdec_pp", options, {}), models, "target")
        assert e.value.name in ("head", "drafter") and all(w in str(e.value) for w in words), str(e.value)
    from tests.support.exact import local_engine
    engine = local_engine(models, tiny_engine.tokenizer, target="target")
    base = dict(prompt="def add(a, b):", max_new_tokens=12, sampling=SamplingParams(0.0), seed=1, ignore_eos=True)
    pp = engine.generate(GenerationRequest(strategy="specdec_pp", options={"head": "drafter-large"}, **base))
    ar = engine.generate(GenerationRequest(strategy="autoregressive", **base))
    assert pp.token_ids == ar.token_ids                                       # lossless with the named head


@pytest.mark.parametrize("head", ["/etc/passwd", "../configs/tiny.yaml", "target", "mag", "drafter-large/.."])
def test_servers_refuse_a_head_that_is_not_a_served_drafter(head):
    from cluster.serving.fronts.grpc_api import fields_from_proto
    from cluster.serving.fronts.completions import fields_from_openai
    from cluster.serving.fronts.requests import build_request
    cfg = load_config("configs/tiny.yaml")
    for fields in (lambda: fields_from_proto(pb.GenerateRequest(prompt="x", strategy="specdec_pp",
                                                                options={"head": head})),
                   lambda: fields_from_openai({"prompt": "x", "strategy": "specdec_pp", "options": {"head": head}})[0]):
        with pytest.raises(ParamError) as e:
            build_request(cfg, fields())
        assert e.value.name == "head" and "drafter-large, drafter-small" in str(e.value)
    fields = fields_from_openai({"prompt": "x", "strategy": "specdec_pp", "options": {"head": "drafter-large"}})[0]
    req = build_request(cfg, fields)
    assert req.options == {"head": "drafter-large"}


def test_guarded_deserializers_and_servicer_functions():
    from unittest.mock import Mock

    from cluster.serving.fronts.grpc_api import malformed_error
    from protos.guard import (
        GUARDED_SERVICER_FUNCTIONS,
        MalformedRequest,
        _guarded,
        add_health_servicer,
        add_specserve_servicer,
    )
    parse = _guarded(pb.GenerateRequest.FromString)
    assert parse(pb.GenerateRequest(prompt="hi").SerializeToString()).prompt == "hi"
    for data, words in ((b"\xff\xff", ["undecodable", "GenerateRequest"]),
                        (b"\x0a\x01" + b"x" * MAX_MESSAGE_BYTES, [str(MAX_MESSAGE_BYTES), "bytes"])):
        bad = parse(data)
        assert isinstance(bad, MalformedRequest) and bad.strategy == ""
        err = malformed_error(bad)
        assert err.name == "request" and all(w in str(err) for w in words) and len(str(err)) < 300

    class Server:
        def __init__(self):
            self.generic, self.registered = [], {}

        def add_generic_rpc_handlers(self, handlers):
            self.generic.extend(handlers)

        def add_registered_method_handlers(self, service, methods):
            self.registered[service] = methods

    server = Server()
    add_specserve_servicer(Mock(), server)
    add_health_servicer(Mock(), server)
    assert set(server.registered) == {"specserve.v1.SpecServe", "grpc.health.v1.Health"}
    assert {"Generate", "GenerateStream", "ServerInfo"} <= set(server.registered["specserve.v1.SpecServe"])
    for methods in server.registered.values():
        for h in methods.values():
            assert isinstance(h.request_deserializer(b"\xff\xff\xff"), MalformedRequest)
    assert len(server.generic) == 2
    assert all(f.startswith("protos.guard.add_") for f in GUARDED_SERVICER_FUNCTIONS)
    from cluster.engine.request import MAX_MESSAGE_BYTES as ENGINE_LIMIT
    from protos.guard import MAX_MESSAGE_BYTES as PROXY_LIMIT
    assert PROXY_LIMIT == ENGINE_LIMIT


def test_http_body_limits():
    import asyncio

    from cluster.serving.fronts.http_api import DRAIN_FACTOR, parse_body, read_body

    class Request:
        def __init__(self, chunks, declared=None):
            self.headers = {} if declared is None else {"content-length": str(declared)}
            self.chunks, self.read = chunks, 0

        async def stream(self):
            for ch in self.chunks:
                self.read += 1
                yield ch

    huge = Request([b"x"] * 10, declared=DRAIN_FACTOR * MAX_MESSAGE_BYTES + 1)
    with pytest.raises(ParamError) as e:
        asyncio.run(read_body(huge))
    assert e.value.name == "body" and huge.read == 0                      # refused before reading
    big = Request([b"x"] * 10, declared=MAX_MESSAGE_BYTES + 1)
    with pytest.raises(ParamError) as e:
        asyncio.run(read_body(big))
    assert e.value.name == "body" and big.read == 10     # drained, unparsed: the client gets its 400, no reset
    chunked = Request([b"x" * (1 << 20)] * 20)
    with pytest.raises(ParamError):
        asyncio.run(read_body(chunked))
    assert chunked.read == 9                                               # stopped once over the limit
    assert asyncio.run(read_body(Request([b'{"a"', b": 1}"]))) == b'{"a": 1}'
    assert parse_body(b'{"p": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\"{{{{", "k": [[1, 2], [0, 3]]}')["k"]
    for raw in (_nested(33).encode(), b"[" * 1_000_000, b'{"a": "\xff"}', b"{", b""):
        with pytest.raises(ParamError) as e:
            parse_body(raw)
        assert e.value.name == "body"


def test_metric_labels_are_validated():
    from cluster.serving.ops.metrics import strategy_label
    assert strategy_label("speculative") == "speculative"
    for bad in ("né", "", None, "x" * 1000, ["speculative"]):
        assert strategy_label(bad) == "invalid"
