"""Stage descriptions: the command-line syntax, YAML files and their errors (parameter, range, value)."""
from __future__ import annotations

import pytest

from cluster.errors import ParamError
from cluster.loadtest.spec import (
    LoadSpec,
    RequestSpec,
    load_spec,
    parse_duration,
    parse_stages,
    request_spec,
    spec_from_dict,
    stages_from_levels,
)


@pytest.mark.parametrize("text, seconds", [("30", 30.0), ("30s", 30.0), ("500ms", 0.5), ("2m", 120.0),
                                           ("1.5s", 1.5), ("1h", 3600.0), (7, 7.0), (0.25, 0.25)])
def test_durations(text, seconds):
    assert parse_duration("duration", text) == seconds


@pytest.mark.parametrize("bad", ["0s", "-1s", "abc", "3d", "", None, True, 86401, "25h"])
def test_bad_durations_name_the_parameter_and_range(bad):
    with pytest.raises(ParamError) as e:
        parse_duration("stages[2].duration", bad)
    assert str(e.value).startswith("invalid stages[2].duration:") and "(0, 86400]" in str(e.value)


def test_cli_stage_syntax():
    base = RequestSpec(max_new_tokens=8, temperature=0.0)
    s = parse_stages("rate=2:30s, c=8:20s:max=100:protocol=http:strategy=autoregressive:tokens=16", base)
    assert [(x.mode, x.value, x.duration_s, x.max_requests) for x in s] == \
        [("rate", 2.0, 30.0, None), ("concurrency", 8.0, 20.0, 100)]
    assert s[0].request == base and s[0].label == "rate=2/s"
    assert s[1].label == "c=8"
    assert (s[1].request.protocol, s[1].request.strategy, s[1].request.max_new_tokens, s[1].request.temperature) == \
        ("http", "autoregressive", 16, 0.0)


@pytest.mark.parametrize("text, name, allowed", [
    ("rate=0:10s", "stages[0].rate", "number in (0.0, 10000.0]"),
    ("c=1:10s,c=0:5s", "stages[1].c", "integer in [1, 4096]"),
    ("c=2:5s:max=0", "stages[0].max_requests", "integer in [1, 1000000]"),
    ("c=2:5s:protocol=udp", "stages[0].request.protocol", "one of grpc, http"),
    ("c=2:5s:color=red", "stages[0].color", "one of max, protocol, strategy, tokens"),
    ("c=2", "stages[0]", "MODE=VALUE:DURATION"),
    ("speed=2:5s", "stages[0].speed", "a known key"),
    ("", "stages", "comma-separated"),
])
def test_cli_stage_errors(text, name, allowed):
    with pytest.raises(ParamError) as e:
        parse_stages(text)
    assert e.value.name == name and allowed in e.value.allowed


def test_levels_shortcut():
    s = stages_from_levels("concurrency", "1,4,16", "20s", "50")
    assert [(x.value, x.duration_s, x.max_requests) for x in s] == [(1.0, 20.0, 50), (4.0, 20.0, 50), (16.0, 20.0, 50)]
    with pytest.raises(ParamError, match=r"invalid rate\[1\].rate"):
        stages_from_levels("rate", "1,-2", "20s", None)


YAML = """
request: {protocol: http, max_new_tokens: 24, temperature: 0, options: {k: 4}, ignore_eos: true}
stages:
  - {rate: 2.5, duration: 30s}
  - {concurrency: 8, duration: 1m, max_requests: 100, request: {protocol: grpc, strategy: autoregressive}}
seed: 3
max_in_flight: 64
retry_after: false
"""


def test_yaml_file_into_typed_spec(tmp_path):
    path = tmp_path / "load.yaml"
    path.write_text(YAML)
    spec = load_spec(path, overrides={"max_new_tokens": 12})
    assert isinstance(spec, LoadSpec) and (spec.seed, spec.max_in_flight, spec.retry_after) == (3, 64, False)
    a, b = spec.stages
    assert (a.mode, a.value, a.duration_s) == ("rate", 2.5, 30.0)
    assert (a.request.protocol, a.request.max_new_tokens, a.request.options, a.request.greedy) == \
        ("http", 12, {"k": "4"}, True)
    assert (b.mode, b.value, b.duration_s, b.max_requests) == ("concurrency", 8.0, 60.0, 100)
    assert (b.request.protocol, b.request.strategy, b.request.ignore_eos) == ("grpc", "autoregressive", True)
    assert spec.time_bound_s == 30 + 60 + 2 * RequestSpec().timeout_s


@pytest.mark.parametrize("data, name", [
    ({"stages": []}, "stages"),
    ({"stages": [{"rate": 2}]}, "stages[0].duration"),
    ({"stages": [{"rate": 2, "concurrency": 3, "duration": 5}]}, "stages[0]"),
    ({"stages": [{"rate": "fast", "duration": 5}]}, "stages[0].rate"),
    ({"stages": [{"c": 2, "duration": 5, "request": {"temperature": -1}}]}, "stages[0].request.temperature"),
    ({"stages": [{"c": 2, "duration": 5, "request": {"tokens": 3}}]}, "stages[0].request.tokens"),
    ({"stages": [{"c": 2, "duration": 5}], "max_in_flight": 0}, "max_in_flight"),
    ({"stages": [{"c": 2, "duration": 5}], "extra": 1}, "extra"),
    ({"request": {"top_p": 0}, "stages": [{"c": 2, "duration": 5}]}, "request.top_p"),
    ([1, 2], "spec"),
])
def test_yaml_errors_name_the_field(data, name):
    with pytest.raises(ParamError) as e:
        spec_from_dict(data)
    assert e.value.name == name, str(e.value)
    assert str(e.value).startswith(f"invalid {name}:") and "(allowed: " in str(e.value)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ParamError, match="invalid spec"):
        load_spec(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("stages: [")
    with pytest.raises(ParamError, match="valid YAML"):
        load_spec(tmp_path / "bad.yaml")


def test_request_overrides_are_checked():
    assert request_spec({"stream": "false", "seed": 5}).stream is False
    with pytest.raises(ParamError, match=r"invalid request.strategy: 'no such!'"):
        request_spec({"strategy": "no such!"})


def test_chat_and_plain_openai_requests():
    r = request_spec({"protocol": "http", "endpoint": "chat", "openai": "true", "model": "other-llm"})
    assert (r.endpoint, r.openai, r.model) == ("chat", True, "other-llm")
    for data, name in (({"endpoint": "responses"}, "request.endpoint"), ({"model": ""}, "request.model"),
                       ({"openai": True}, "request.protocol"),                     # gRPC is specserve's own
                       ({"protocol": "http", "openai": True, "strategy": "mag"}, "request.strategy"),
                       ({"protocol": "http", "openai": True, "options": {"k": 2}}, "request.options")):
        with pytest.raises(ParamError) as e:
            request_spec(data)
        assert e.value.name == name, (data, str(e.value))


def test_plain_openai_body_has_no_specserve_field():
    from cluster.loadtest.clients import Caller, Target
    t = Target(grpc=None, http="http://127.0.0.1:1/v1")
    plain = Caller(t, request_spec({"protocol": "http", "endpoint": "chat", "openai": True, "model": "m",
                                    "temperature": 0, "seed": 1}))
    assert plain.url == "http://127.0.0.1:1/v1/chat/completions"           # an OpenAI base URL, /v1 once
    kw = dict(max_new_tokens=5, temperature=0.0, top_p=None, seed=1, strategy=None, options={}, ignore_eos=False)
    assert plain._body("hi", kw) == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
                                     "model": "m", "temperature": 0.0, "seed": 1,
                                     "stream_options": {"include_usage": True}}
    ours = Caller(Target(grpc=None, http="http://127.0.0.1:1"), request_spec({"protocol": "http"}))
    assert ours.url == "http://127.0.0.1:1/v1/completions"
    body = ours._body("hi", {**kw, "strategy": "mag", "options": {"k": "2"}})
    assert body["prompt"] == "hi" and body["strategy"] == "mag" and body["options"] == {"k": "2"}
