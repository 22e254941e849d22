"""The OpenAI-compatible HTTP API (cluster/serving/fronts/http_app.py, http_api.py) without Ray: the replica's FastAPI
app driven in-process over a coordinator stand-in that runs the real in-process engine (configs/tiny.yaml),
so validation messages are the engine's own.  The served cluster's tests (test_serve.py, test_fuzz.py,
test_metrics_export.py) drive the same app through Ray Serve's HTTP proxy."""
from __future__ import annotations

import json
import pytest

from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import DeadlineExceededError, ModelUnavailableError, OverloadedError
from cluster.serving.ops.error_table import COUNTED, refusal_outcome
from tests.support.asgi import call
from tests.support.fake_coordinator import CFG

MODEL = CFG.cluster.app_name


def _post(app, body, path="/v1/completions", raw: bytes | None = None, headers=None):
    data = raw if raw is not None else json.dumps(body).encode()
    return call(app, "POST", path, body=data, headers=headers)


BASE = {"prompt": "def main():", "max_tokens": 6, "temperature": 0, "seed": 3}


def test_completion_models_and_health(app, tiny_engine):
    a, dep = app
    r = _post(a, {**BASE, "model": MODEL, "user": "someone", "n": 1, "echo": False, "best_of": 1, "logit_bias": {},
                  "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None})    # "off" values: served
    out = r.json()
    assert r.status == 200 and out["model"] == MODEL and out["object"] == "text_completion"
    assert out["usage"]["completion_tokens"] == len(out["specserve"]["token_ids"]) == 6
    want = tiny_engine.generate(GenerationRequest(prompt="def main():", max_new_tokens=6, sampling=SamplingParams(0.0),
                                                  seed=3))
    assert out["choices"][0]["text"] == want.text and out["choices"][0]["finish_reason"] in ("length", "stop")
    models = call(a, "GET", "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["object"] == "list"
    assert call(a, "GET", "/health").json() == {"ready": True}
    dep.coord.ready = False
    r = call(a, "GET", "/health")
    assert r.status == 503 and r.headers["retry-after"] == "1"


def test_unknown_model_is_404_as_vllm(app):
    a, dep = app
    r = _post(a, {**BASE, "model": "gpt-4"})
    err = r.json()["error"]
    assert r.status == 404 and err["param"] == "model" and err["type"] == "not_found_error" and err["code"] == 404
    assert "'gpt-4'" in err["message"] and MODEL in err["message"]
    assert dep.coord.metrics.records == [(CFG.engine.strategy, "not_found")]


@pytest.mark.parametrize("extra,name,words", [
    ({"n": 2}, "n", ["not supported", "1", "2"]),
    ({"best_of": 3}, "best_of", ["not supported", "3"]),
    ({"logprobs": 21}, "logprobs", ["20", "21"]),
    ({"suffix": "x"}, "suffix", ["not supported", "'x'"]),
    ({"presence_penalty": 0.5}, "presence_penalty", ["not supported", "0.5"]),
    ({"frequency_penalty": -1}, "frequency_penalty", ["not supported"]),
    ({"repetition_penalty": 1.2}, "repetition_penalty", ["not supported", "1.2"]),
    ({"min_tokens": 3}, "min_tokens", ["not supported", "3"]),
    ({"logit_bias": {"5": 100}}, "logit_bias", ["not supported", "'5'"]),
    ({"stream_options": {"include_usage": True}}, "stream_options", ["stream: true"]),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options", ["include_usage"]),
    ({"frobnicate": 1}, "frobnicate", ["not a parameter of /v1/completions", "max_tokens"]),
    ({"max_tokens": "3"}, "max_tokens", ["integer", "'3'"]),
    ({"max_tokens": 2.0}, "max_tokens", ["integer", "2.0"]),
    ({"max_tokens": 10**30}, "max_tokens", [f"integer in [1, {CFG.engine.max_new_tokens_limit}]"]),
    ({"temperature": -1}, "temperature", ["-1", "allowed"]),
    ({"temperature": "0.5"}, "temperature", ["number", "'0.5'"]),
    ({"top_p": 1.5}, "top_p", ["(0.0, 1.0]", "1.5"]),
    ({"stream": "yes"}, "stream", ["true or false", "'yes'"]),
    ({"prompt": {"a": 1}}, "prompt", ["a string or a list of token ids"]),
    ({"prompt": "\ud800"}, "prompt", ["surrogate"]),
    ({"stop": [1]}, "stop", ["a string or a list of strings"]),
    ({"strategy": "nope"}, "strategy", ["one of", "speculative", "'nope'"]),
    ({"options": {"k": 0}}, "k", ["0"]),
    ({"model": 5}, "model", ["the served model id"]),
])
def test_refusals_name_the_parameter_range_and_value(app, extra, name, words):
    a, dep = app
    strategy = "speculative" if name == "k" else None
    body = {**BASE, **extra, **({"strategy": strategy} if strategy else {})}
    r = _post(a, body)
    err = r.json()["error"]
    assert r.status == 400 and err["param"] == name and err["type"] == "invalid_request_error", err
    assert err["message"].startswith(f"invalid {name}: ") and "allowed" in err["message"]
    for w in words:
        assert w in err["message"], (w, err["message"])
    assert [o for _, o in dep.coord.metrics.records] == ["invalid"]


def test_hostile_bodies_get_400_not_500(app):
    a, _ = app
    cases = [(b"[" * 200_000, "body"), (b'{"prompt": "x", "options": ' + b"[" * 40 + b"]" * 40 + b"}", "body"),
             (b"{", "body"), (b'{"prompt": "\xff"}', "body"), (b"[1, 2]", "body"), (b"null", "body"),
             (json.dumps({"\ud800": 1, "prompt": "x"}).encode(), "'\\ud800'"),
             (json.dumps({"x" * 100: 1, "prompt": "x"}).encode(), "'xxxxxxxx")]
    for raw, param in cases:
        r = _post(a, None, raw=raw)
        err = r.json()["error"]                                   # valid JSON, lone surrogates escaped
        assert r.status == 400 and err["param"].startswith(param), (raw[:40], err)
        assert "Traceback" not in err["message"] and len(err["message"]) < 1024
    big = call(a, "POST", "/v1/completions", body=b"{}", headers={"content-length": str(10**9)})
    assert big.status == 400 and big.json()["error"]["param"] == "body"   # refused on the declared size


def test_status_codes_retry_after_and_counting(app):
    a, dep = app
    coord = dep.coord
    counted = DeadlineExceededError("request r ran past its deadline of 1s")
    setattr(counted, COUNTED, True)                       # as the coordinator marks an error it counted
    for exc, status, retry in ((OverloadedError("queue full"), 429, True), (ModelUnavailableError("target"), 503, True),
                               (counted, 504, False), (RuntimeError("secret /work/x"), 500, False)):
        coord.fail_with = exc
        r = _post(a, BASE)
        assert r.status == status and ("retry-after" in r.headers) == retry, (exc, r.headers)
        assert r.headers.get("x-should-retry") == (None if retry else "false")     # 500 / 504: the SDKs don't retry
        assert "secret" not in r.json()["error"]["message"]
    assert [o for _, o in coord.metrics.records] == ["overloaded", "unavailable", "error"]   # 504: counted once


def test_streaming_server_sent_events(app):
    a, dep = app
    whole = _post(a, BASE).json()
    chunks = _post(a, {**BASE, "stream": True}).sse_chunks()
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all("usage" not in c for c in chunks)                              # none without include_usage
    assert chunks[-1]["specserve"]["token_ids"] == whole["specserve"]["token_ids"]
    assert len({c["id"] for c in chunks}) == 1
    events = _post(a, {**BASE, "stream": True, "stream_options": {"include_usage": True}}).events()
    last = json.loads(events[-2])                                             # one usage chunk, no choices
    assert events[-1] == "[DONE]" and last["choices"] == [] and last["usage"] == whole["usage"]
    assert all("usage" not in json.loads(e) for e in events[:-2])
    events = _post(a, {**BASE, "stream": True, "stream_options": {"include_usage": True,
                                                                  "continuous_usage_stats": True}}).events()
    counts = [json.loads(e)["usage"]["completion_tokens"] for e in events[:-1]]
    assert counts == sorted(counts) and counts[-1] == whole["usage"]["completion_tokens"]
    dep.coord.fail_with = OverloadedError("queue full")           # refused at admission: a status, not a stream
    r = _post(a, {**BASE, "stream": True})
    assert r.status == 429 and r.headers["retry-after"] == "1"
    dep.coord.fail_with, dep.coord.fail_after_first = None, ModelUnavailableError("target")
    events = _post(a, {**BASE, "stream": True}).events()          # fails after the status was sent
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503


def test_unknown_routes_and_methods_are_openai_errors(app):
    a, _ = app
    for method, path, status in (("POST", "/nope", 404), ("POST", "/v1/completion", 404),
                                 ("GET", "/v1/completions", 405)):
        r = call(a, method, path, body=b"{}")
        err = r.json()["error"]
        assert r.status == status and err["code"] == status and err["message"], (path, r.body)


def test_refusal_outcomes():
    from cluster.errors import ParamError
    from cluster.serving.ops.auth import Unauthenticated
    assert [refusal_outcome(e) for e in (ParamError("x", "y", 1), OverloadedError(), ModelUnavailableError("t"),
                                         Unauthenticated(), DeadlineExceededError(), KeyError())] == \
        ["invalid", "overloaded", "unavailable", "unauthenticated", "deadline", "error"]
    e = ModelUnavailableError("t")
    setattr(e, COUNTED, True)
    assert refusal_outcome(e) is None


def test_serve_ingress_keeps_the_grpc_methods():
    """Serve's late-bound ingress (serve.ingress() + __serve_build_asgi_app__) wraps the deployment class;
    the gRPC proxy calls the wrapper's methods by name, so Generate & co. must be the class's own."""
    serve = pytest.importorskip("ray.serve")
    from ray.serve._private.http_util import ASGIAppReplicaWrapper

    from cluster.serving.fronts.app import SpecServeDeployment
    wrapped = serve.ingress()(SpecServeDeployment)
    assert issubclass(wrapped, ASGIAppReplicaWrapper) and issubclass(wrapped, SpecServeDeployment)
    for method in ("Generate", "GenerateStream", "ServerInfo", "Check", "Watch", "check_health"):
        assert getattr(wrapped, method) is getattr(SpecServeDeployment, method)
    assert wrapped.__serve_build_asgi_app__ is SpecServeDeployment.__serve_build_asgi_app__


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(app):
    """The same long prompt twice: the second finds all but its last block's tail in the cache, unary and in the
    streamed usage chunk (OpenAI's ``usage.prompt_tokens_details.cached_tokens``)."""
    a, _ = app
    body = {**BASE, "prompt": "def main():\n    " + "x = 1\n    " * 12 + "return x"}
    first = _post(a, body).json()["usage"]
    second = _post(a, body).json()["usage"]
    events = _post(a, {**body, "stream": True, "stream_options": {"include_usage": True}}).events()
    streamed = json.loads(events[-2])["usage"]
    assert first["prompt_tokens"] >= 32 and first["prompt_tokens_details"]["cached_tokens"] < first["prompt_tokens"]
    assert 16 <= second["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens"]
    assert streamed["prompt_tokens_details"] == second["prompt_tokens_details"]
