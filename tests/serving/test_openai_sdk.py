"""The official ``openai`` SDK against the served cluster (the session's ``served`` fixture: Ray Serve's HTTP
proxy on configs/tiny.yaml): chat plain and streamed with usage, completions, and one gRPC chat call with
logprobs through the same cluster."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "def fib(n):"}]
GREEDY = dict(temperature=0, seed=5, extra_body={"ignore_eos": True})     # the tiny model is random



def test_sdk_chat_plain_and_streamed(sdk):
    cfg, client = sdk
    r = client.chat.completions.create(model=cfg.cluster.app_name, messages=MESSAGES, max_completion_tokens=6,
                                       **GREEDY)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=cfg.cluster.app_name, messages=MESSAGES, max_completion_tokens=6,
                                            stream=True, stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_sdk_completions_and_errors(sdk):
    cfg, client = sdk
    r = client.completions.create(model=cfg.cluster.app_name, prompt="import os", max_tokens=4, logprobs=1, **GREEDY)
    assert r.usage.completion_tokens == 4 and len(r.choices[0].logprobs.token_logprobs) == 4
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=cfg.cluster.app_name, prompt="x", max_tokens=2, presence_penalty=1.5)
    assert "presence_penalty" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2)


def test_grpc_chat_with_logprobs(served):
    _, client = served
    r = client.generate(messages=MESSAGES, max_new_tokens=4, temperature=0.0, seed=5, ignore_eos=True, logprobs=2)
    assert len(r.token_ids) == 4 and [x.token_id for x in r.logprobs] == list(r.token_ids)
    assert all(len(x.top_ids) == 2 and x.top_logprobs[0] >= x.logprob for x in r.logprobs)


def test_cli_client_chat(served, capsys):
    from cluster.cli.main import main
    cfg, _ = served
    rc = main(["client", "--address", f"127.0.0.1:{cfg.cluster.grpc_port}", "--app", cfg.cluster.app_name,
               "--chat", "def fib(n):", "--max-new-tokens", "3", "--temperature", "0", "--logprobs", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    tokens = out.get("tokenIds", [])                  # MessageToDict leaves out an empty list
    assert rc == 0 and len(tokens) <= 3 and len(out.get("logprobs", [])) == len(tokens) and out["finishReason"]
    rc = main(["client", "--address", f"127.0.0.1:{cfg.cluster.grpc_port}", "--app", cfg.cluster.app_name,
               "--chat", "x", "--logprobs", "99"])
    assert rc == 2 and "invalid logprobs" in capsys.readouterr().err


def test_sdk_predicted_output_edit(sdk, served):
    """A predicted-output edit as docs/operator-guide.md shows it: the SDK's own ``prediction`` parameter, its usage details,
    the answer unchanged by the prediction (greedy), vLLM's speculative metrics read from the raw body; and the
    same prediction over gRPC."""
    cfg, client = sdk
    code = "def add(a, b):\n    return a + b\n"
    messages = [{"role": "user", "content": "Rename add to plus:\n" + code}]
    plain = client.chat.completions.create(model=cfg.cluster.app_name, messages=messages, max_completion_tokens=12,
                                           **GREEDY)
    r = client.chat.completions.with_raw_response.create(
        model=cfg.cluster.app_name, messages=messages, max_completion_tokens=12,
        prediction={"type": "content", "content": code}, **GREEDY)
    parsed, body = r.parse(), json.loads(r.text)
    assert parsed.choices[0].message.content == plain.choices[0].message.content
    details = parsed.usage.completion_tokens_details
    st = body["specserve"]["stats"]
    assert details.accepted_prediction_tokens == st["prediction_accepted"]
    # (the tiny models' answer does not follow the code, so the prediction may draft nothing: it never displaces
    # the drafter where the output does not agree with it, cluster/core/prediction.py)
    assert details.rejected_prediction_tokens == st["prediction_drafted"] - st["prediction_accepted"] >= 0
    assert body["metrics"]["speculative_decoding"]["num_drafts"] == st["steps"]
    _, c = served
    g = c.generate(messages=messages, max_new_tokens=12, temperature=0.0, seed=5, ignore_eos=True, prediction=code)
    assert g.text == plain.choices[0].message.content and g.stats.prediction_drafted == st["prediction_drafted"]
