"""The goal of issue 33 items 1-2 with the official ``openai`` SDK against the served cluster (the session's
``served`` fixture: configs/tiny.yaml with the Max-Gram drafter): the tool-calling loop (tools with
``tool_choice: required``, the call answered by a ``tool`` message, then a final answer held to a JSON schema)
and ``response_format: json_schema``, streamed and not, for autoregressive, speculative, mag and cs_drafting.
Every call's arguments and every JSON answer validate against their schema; the models are random, so only
the grammar makes them valid, and greedy outputs are the same under every strategy (each samples the
constrained target law exactly: cluster/core/constraint.py).  Bad values get 400 naming the field."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

STRATEGIES = ("autoregressive", "speculative", "mag", "cs_drafting")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast of a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["answer", "confidence"], "additionalProperties": False}
JSON_ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}



def _args(cfg, messages, strategy, **kw) -> dict:
    return dict(model=cfg.cluster.app_name, messages=messages, max_completion_tokens=160, temperature=0, seed=3,
                extra_body={"strategy": strategy}, **kw)


def _ask(client, cfg, messages, stream, strategy, **kw):
    """(content, [(id, name, arguments)], finish_reason) of one chat completion, streamed or not."""
    args = _args(cfg, messages, strategy, **kw)
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **args):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            got = calls.setdefault(c.index, ["", "", ""])
            got[0] += c.id or ""
            got[1] += (c.function.name or "") if c.function else ""
            got[2] += (c.function.arguments or "") if c.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_tool_loop_and_json_answer_under_every_strategy(sdk, stream):
    cfg, client = sdk
    seen = {}
    for strategy in STRATEGIES:
        messages = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
        content, calls, finish = _ask(client, cfg, messages, stream, strategy, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False)
        assert finish == "tool_calls" and len(calls) == 1, (strategy, content, calls, finish)
        call_id, name, arguments = calls[0]
        assert call_id.startswith("call_") and name in ("get_weather", "get_time")
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(json.loads(arguments), schema)
        said = {"role": "assistant", "content": content, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}
        if not stream:       # the SDK's own message object, as OpenAI's examples append it (null extras included)
            said = client.chat.completions.create(**_args(cfg, messages, strategy, tools=TOOLS, tool_choice="required",
                                                          parallel_tool_calls=False)).choices[0].message
            assert said.tool_calls[0].function.arguments == arguments
            call_id = said.tool_calls[0].id
        messages += [said, {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"}]
        final, more, finish = _ask(client, cfg, messages, stream, strategy, tools=TOOLS, response_format=JSON_ANSWER)
        assert finish == "stop" and more == [], (strategy, final, finish)
        jsonschema.validate(json.loads(final), ANSWER)
        named, calls, finish = _ask(client, cfg, messages[:1], stream, strategy, tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert finish == "stop" and {c[1] for c in calls} == {"get_time"}     # a named call: "stop", as vLLM
        for _, _, arguments in calls:
            jsonschema.validate(json.loads(arguments), TOOLS[1]["function"]["parameters"])
        seen[strategy] = (name, arguments, final, tuple(c[2] for c in calls))
    assert len(set(seen.values())) == 1, seen          # greedy: the constrained target law, whatever the strategy


def test_sdk_json_object_and_free_text_with_tools(sdk):
    cfg, client = sdk
    messages = [{"role": "user", "content": "Give me a JSON object."}]
    content, calls, finish = _ask(client, cfg, messages, False, "speculative", response_format={"type": "json_object"},
                                  max_tokens=None)
    if finish == "stop":
        assert isinstance(json.loads(content), dict) and calls == []
    content, calls, finish = _ask(client, cfg, messages, False, "speculative", tools=TOOLS, tool_choice="auto")
    assert calls == [] and finish in ("stop", "length") and content      # a random model calls nothing


@pytest.mark.parametrize("kw,field", [
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}),
     "response_format"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format=JSON_ANSWER), "response_format"),
    (dict(response_format=JSON_ANSWER, extra_body={"strategy": "lossy"}), "response_format"),
])
def test_bad_values_are_400_naming_the_field(sdk, kw, field):
    cfg, client = sdk
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=cfg.cluster.app_name, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, **kw)
    assert e.value.body["param"] == field, e.value.body


@pytest.mark.parametrize("stream", [False, True])
def test_grpc_tool_loop_and_json_answer(served, stream):
    """The same loop over gRPC (tools / response_format as JSON text, tool calls as ToolCall messages)."""
    _, client = served

    def ask(**kw):
        args = dict(max_new_tokens=160, temperature=0.0, seed=3, strategy="speculative", **kw)
        return client.generate(**args) if not stream else list(client.stream(**args))[-1].result
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = ask(messages=messages, tools=TOOLS, tool_choice="get_weather")
    assert len(r.tool_calls) == 1 and r.tool_calls[0].name == "get_weather" and r.content == ""
    jsonschema.validate(json.loads(r.tool_calls[0].arguments), WEATHER)
    call = r.tool_calls[0]
    messages += [{"role": "assistant", "content": "", "tool_calls": [
                     {"id": call.id, "name": call.name, "arguments": call.arguments}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    final = ask(messages=messages, tools=TOOLS, response_format=JSON_ANSWER)
    assert final.finish_reason == "eos" and not final.tool_calls
    jsonschema.validate(json.loads(final.text), ANSWER)


def test_grpc_bad_tool_choice_is_invalid_argument(served):
    import grpc
    _, client = served
    with pytest.raises(grpc.RpcError) as e:
        client.generate(messages=[{"role": "user", "content": "x"}], max_new_tokens=4, tools=TOOLS,
                        tool_choice="launch")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tool_choice" in e.value.details()
