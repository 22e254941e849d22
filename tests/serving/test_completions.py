"""``/v1/completions`` logprobs and echo (cluster/serving/fronts/completions.py) against the engine's own numbers,
through the replica's HTTP app over the tiny engine."""
from __future__ import annotations

import json

from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from tests.support.asgi import call

BASE = {"prompt": "def main():", "max_tokens": 5, "temperature": 0, "seed": 2, "ignore_eos": True}


def _post(app, body):
    return call(app, "POST", "/v1/completions", body=json.dumps(body).encode())


def _engine(tiny_engine, **kw):
    return tiny_engine.generate(GenerationRequest(prompt="def main():", max_new_tokens=5, sampling=SamplingParams(0.0),
                                                  seed=2, ignore_eos=True, **kw))


def test_logprobs_object_is_the_targets(app, tiny_engine):
    out = _post(app[0], {**BASE, "logprobs": 2}).json()
    want = _engine(tiny_engine, logprobs=2)
    lp, text = out["choices"][0]["logprobs"], out["choices"][0]["text"]
    assert lp["token_logprobs"] == [x.logprob for x in want.logprobs]
    assert lp["tokens"] == [tiny_engine.tokenizer.decode([t]) for t in want.token_ids]
    for top, x in zip(lp["top_logprobs"], want.logprobs):         # token text -> logprob, the most likely per text
        assert max(top.values()) == x.top[0][1] and top[tiny_engine.tokenizer.decode([x.token_id])] == x.logprob
        assert all(top[tiny_engine.tokenizer.decode([t])] >= v for t, v in x.top)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert "".join(lp["tokens"]) == text
    chunks = _post(app[0], {**BASE, "logprobs": 2, "stream": True}).sse_chunks()
    streamed = [x for c in chunks for x in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert streamed == lp["token_logprobs"]
    assert _post(app[0], BASE).json()["choices"][0]["logprobs"] is None                 # not asked: none


def test_echo_puts_the_prompt_first(app, tiny_engine):
    out = _post(app[0], {**BASE, "echo": True, "logprobs": 0}).json()
    want = _engine(tiny_engine, logprobs=0, prompt_logprobs=0)
    choice = out["choices"][0]
    assert choice["text"] == "def main():" + want.text
    n = len("def main():")                                                     # one byte token per character
    assert choice["logprobs"]["token_logprobs"] == [None] + [x.logprob for x in want.prompt_logprobs[1:]] + \
        [x.logprob for x in want.logprobs]
    assert choice["logprobs"]["text_offset"][n] == n
    assert _post(app[0], {**BASE, "echo": True}).json()["choices"][0]["text"] == choice["text"]
    zero = _post(app[0], {**BASE, "echo": True, "max_tokens": 0}).json()                # prompt only
    assert zero["choices"][0]["text"] == "def main():" and zero["usage"]["completion_tokens"] == 0
    chunks = _post(app[0], {**BASE, "echo": True, "stream": True}).sse_chunks()
    assert chunks[0]["choices"][0]["text"] == "def main():"
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


def test_echo_refusals(app):
    for body, name in (({**BASE, "echo": True, "logprobs": 1, "stream": True}, "echo"),
                       ({**BASE, "max_tokens": 0}, "max_tokens"), ({**BASE, "logprobs": -1}, "logprobs")):
        err = _post(app[0], body).json()["error"]
        assert err["param"] == name and err["code"] == 400, (body, err)
