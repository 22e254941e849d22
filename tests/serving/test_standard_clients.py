"""Standard clients' real request payloads (tests/serving/fixtures/*.json, each with the ``_source`` it was
copied from) answered 200 in the shape each tool reads, through the replica's HTTP app over the tiny engine.
What each tool reads is asserted as the tool reads it (vLLM's bench and guidellm: text per chunk and the usage
chunk's ``completion_tokens``; lm-eval: ``token_logprobs[ctxlen:-1]`` and greedy-ness from ``top_logprobs``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.asgi import call

FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("*.json"))


def _send(app, name: str):
    fx = json.loads((Path(__file__).parent / "fixtures" / name).read_text())
    assert "_source" in fx and "commit" in fx["_source"]
    return fx["payload"], call(app, "POST", fx["path"], body=json.dumps(fx["payload"]).encode())


@pytest.mark.parametrize("name", ["vllm_bench_openai.json", "guidellm_completions.json"])
def test_streamed_completions(app, name):
    payload, r = _send(app[0], name)
    chunks = r.sse_chunks()
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices and all(isinstance(c["choices"][0]["text"], str) for c in with_choices)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == payload["max_tokens"]
    if payload["stream_options"].get("continuous_usage_stats"):               # guidellm: usage on every chunk
        assert all("usage" in c for c in chunks)


@pytest.mark.parametrize("name", ["vllm_bench_openai_chat.json", "guidellm_chat.json"])
def test_streamed_chat(app, name):
    payload, r = _send(app[0], name)
    chunks = r.sse_chunks()
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert isinstance(text, str) and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == payload["max_completion_tokens"]


def test_lm_eval_loglikelihood(app, tiny_engine):
    payload, r = _send(app[0], "lmeval_loglikelihood.json")
    assert r.status == 200, r.body
    (choice,) = r.json()["choices"]
    (ids,) = payload["prompt"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None          # as OpenAI answers
    ctxlen = 4                                                          # lm-eval: context tokens, then continuation
    continuation = lp["token_logprobs"][ctxlen:-1]
    assert all(isinstance(x, float) and x <= 0 for x in continuation) and sum(continuation) < 0
    for tok, top, text in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], lp["tokens"][1:]):
        assert top[text] == tok and max(top.values()) >= tok      # lm-eval's greedy check reads max(top)
    assert choice["text"].startswith(tiny_engine.tokenizer.decode(ids))                # echo: the prompt first
    zero = call(app[0], "POST", "/v1/completions", body=json.dumps({**payload, "max_tokens": 0}).encode()).json()
    assert zero["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(ids)]   # scored alone
    assert len(zero["choices"][0]["logprobs"]["tokens"]) == len(ids) and zero["usage"]["completion_tokens"] == 0


def test_lm_eval_generate_until(app):
    payload, r = _send(app[0], "lmeval_generate_until.json")
    out = r.json()
    assert r.status == 200 and out["choices"][0]["index"] == 0 and isinstance(out["choices"][0]["text"], str)
    assert out["usage"]["completion_tokens"] <= payload["max_tokens"]


def test_every_fixture_is_tested():
    tested = {"vllm_bench_openai.json", "guidellm_completions.json", "vllm_bench_openai_chat.json",
              "guidellm_chat.json", "lmeval_loglikelihood.json", "lmeval_generate_until.json"}
    assert {p.name for p in FIXTURES} == tested
