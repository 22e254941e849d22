"""``POST /v1/chat/completions`` through the replica's HTTP app over the in-process tiny engine (no Ray): the
OpenAI shapes, streaming with the role delta, usage and [DONE], logprobs, and refusals naming ``messages``."""
from __future__ import annotations

import json
from types import SimpleNamespace

from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.models.chat_template import render_chat
from tests.support.asgi import call
from tests.support.fake_coordinator import http_app

MESSAGES = [{"role": "system", "content": "you write python"}, {"role": "user", "content": "def main():"}]
BASE = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "seed": 3, "ignore_eos": True}   # random model


def _post(app, body):
    return call(app, "POST", "/v1/chat/completions", body=json.dumps(body).encode())


def _expected(engine, **kw):
    prompt = render_chat(engine.tokenizer, MESSAGES)
    return engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=6, sampling=SamplingParams(0.0), seed=3,
                                             ignore_eos=True, **kw))


def test_chat_completion_is_the_templated_prompt_completed(app, tiny_engine):
    a, _ = app
    r = _post(a, {**BASE, "n": 1, "presence_penalty": 0, "stop": None, "user": "u"})   # neutral values
    out = r.json()
    want = _expected(tiny_engine)
    assert r.status == 200 and out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    (choice,) = out["choices"]
    assert choice["message"] == {"role": "assistant", "content": want.text} and choice["logprobs"] is None
    assert choice["finish_reason"] in ("stop", "length")
    prompt_ids = tiny_engine.tokenizer.encode(render_chat(tiny_engine.tokenizer, MESSAGES))
    cached = out["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert 0 <= cached < len(prompt_ids) and cached % 16 == 0          # whole blocks of the prefix cache
    assert out["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(want.token_ids),
                            "total_tokens": len(prompt_ids) + len(want.token_ids)}
    max_completion = _post(a, {**BASE, "max_tokens": 50, "max_completion_tokens": 2}).json()
    assert max_completion["usage"]["completion_tokens"] == 2                  # max_completion_tokens wins


def test_chat_stream_role_first_usage_last(app):
    a, _ = app
    whole = _post(a, BASE).json()
    chunks = _post(a, {**BASE, "stream": True}).sse_chunks()
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    events = _post(a, {**BASE, "stream": True, "stream_options": {"include_usage": True}}).events()
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert all("usage" not in json.loads(e) for e in events[:-2])


def test_chat_logprobs_are_the_targets(app, tiny_engine):
    a, _ = app
    out = _post(a, {**BASE, "logprobs": True, "top_logprobs": 2}).json()
    want = _expected(tiny_engine, logprobs=2)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == len(want.token_ids)
    for entry, lp in zip(content, want.logprobs):
        assert entry["logprob"] == lp.logprob and entry["token"] == tiny_engine.tokenizer.decode([lp.token_id])
        assert entry["bytes"] == list(entry["token"].encode()) and len(entry["top_logprobs"]) == 2
        assert [t["logprob"] for t in entry["top_logprobs"]] == [v for _, v in lp.top]
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    events = _post(a, {**BASE, "logprobs": True, "stream": True}).events()
    streamed = [e for c in events[:-1] for e in ((json.loads(c)["choices"][0]["logprobs"] or {}).get("content", []))]
    assert [e["logprob"] for e in streamed] == [e["logprob"] for e in content]
    assert all(e["top_logprobs"] == [] for e in streamed)                     # top_logprobs unset: none


def test_chat_refusals_name_the_parameter(app):
    a, dep = app
    for extra, name in (({"messages": "hi"}, "messages"), ({"messages": [{"role": "bot", "content": "x"}]}, "messages"),
                        ({"messages": [{"role": "user", "content": 3}]}, "messages"),
                        ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
                        ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"max_tokens": 0}, "max_tokens"),
                        ({"echo": True}, "echo"), ({"tools": [{"type": "function"}]}, "tools"),
                        ({"prompt": "x"}, "prompt")):
        r = _post(a, {**BASE, **extra})
        err = r.json()["error"]
        assert r.status == 400 and err["param"] == name and err["type"] == "invalid_request_error", (extra, err)
        assert "allowed" in err["message"]
    assert _post(a, {**BASE, "model": "gpt-4"}).status == 404


def test_model_without_a_chat_template_is_400_naming_messages(tiny_engine):
    no_template = SimpleNamespace(tok=SimpleNamespace(chat_template=None), encode=tiny_engine.tokenizer.encode)
    engine = SimpleNamespace(tokenizer=no_template, prepare=tiny_engine.prepare, stream=tiny_engine.stream)
    a, dep = http_app(engine)
    r = _post(a, BASE)
    err = r.json()["error"]
    assert r.status == 400 and err["param"] == "messages" and "chat template" in err["message"]
    assert dep.coord.metrics.records[-1][1] == "invalid"


TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"], "additionalProperties": False}}}]


def test_tool_call_wire_shapes_whole_and_streamed(app):
    """OpenAI's (and vLLM's) shapes: message.tool_calls with content null, finish_reason tool_calls; streamed, one
    delta.tool_calls entry per call with index, id, type and the function's name and arguments."""
    a, _ = app
    body = {**BASE, "ignore_eos": False, "max_tokens": 80, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False}
    choice = _post(a, body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and set(choice["message"]) == {"role", "content", "tool_calls"}
    assert choice["message"]["content"] is None
    (call_,) = choice["message"]["tool_calls"]
    assert set(call_) == {"id", "type", "function"} and call_["type"] == "function" and call_["id"].startswith("call_")
    assert call_["function"]["name"] == "pick" and json.loads(call_["function"]["arguments"])["n"] in (1, 2, 3)
    chunks = _post(a, {**body, "stream": True}).sse_chunks()
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)                # the call's text is never content
    (streamed,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert [{k: v for k, v in s.items() if k != "id"} for s in streamed] == \
        [{"index": 0, "type": "function", "function": call_["function"]}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_json_schema_answer_and_free_auto(app):
    a, _ = app
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = _post(a, {**BASE, "ignore_eos": False, "max_tokens": 40, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}}).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(out["choices"][0]["message"]["content"])["ok"], bool)
    free = _post(a, {**BASE, "tools": TOOLS}).json()["choices"][0]          # auto: a random model calls nothing
    assert "tool_calls" not in free["message"] and free["message"]["content"]
