"""OpenAI's ``prediction`` (both endpoints), vLLM's ``chat_template_kwargs`` (chat) and ``metrics.speculative_decoding``
through the replica's HTTP app over the in-process tiny engine (no Ray)."""
from __future__ import annotations

import json

import pytest

from cluster.errors import ParamError
from cluster.models.chat_template import render_chat
from cluster.models.tokenizer import HFTokenizer
from cluster.serving.fronts.oai_fields import prediction_text, speculative_decoding
from tests.support.asgi import call
from tests.support.checkpoints import write_word_tokenizer

MESSAGES = [{"role": "user", "content": "def main():"}]
CHAT = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0, "seed": 3, "ignore_eos": True}
COMPLETION = {"prompt": "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n", "max_tokens": 24, "temperature": 0,
              "seed": 3, "ignore_eos": True}


def _post(app, path, body):
    return call(app, "POST", path, body=json.dumps(body).encode())


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_prediction_leaves_greedy_output_unchanged_and_reports_its_tokens(app, path, base):
    a, _ = app
    plain = _post(a, path, base).json()
    text = plain["choices"][0].get("text", plain["choices"][0].get("message", {}).get("content"))
    assert "completion_tokens_details" not in plain["usage"]          # no prediction: OpenAI's shape without it
    for content in (text, [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}], "x = 1\n" * 9):
        out = _post(a, path, {**base, "prediction": {"type": "content", "content": content}}).json()
        assert out["specserve"]["token_ids"] == plain["specserve"]["token_ids"]
        st = out["specserve"]["stats"]
        details = out["usage"]["completion_tokens_details"]
        assert details == {"accepted_prediction_tokens": st["prediction_accepted"],
                           "rejected_prediction_tokens": st["prediction_drafted"] - st["prediction_accepted"]}
        # the answer itself predicted: the prediction leads -- where its text re-encodes to the answer's tokens
        # (the tiny models' bytes are not always UTF-8: U+FFFD in the text)
        if content != "x = 1\n" * 9 and "\ufffd" not in text:
            assert st["prediction_accepted"] > 0
    events = _post(a, path, {**base, "stream": True, "stream_options": {"include_usage": True},
                             "prediction": {"type": "content", "content": text}}).sse_chunks()
    last = events[-1]
    assert last["choices"] == [] and "accepted_prediction_tokens" in last["usage"]["completion_tokens_details"]


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_bad_predictions_are_400_naming_prediction(app, path, base):
    a, _ = app
    for bad in ("text", {"type": "content"}, {"type": "text", "content": "x"}, {"type": "content", "content": 5},
                {"type": "content", "content": ""}, {"type": "content", "content": [{"type": "image_url"}]},
                {"type": "content", "content": []}, {"type": "content", "content": "x", "extra": 1},
                {"type": "content", "content": "\ud800"}):
        r = _post(a, path, {**base, "prediction": bad})
        err = r.json()["error"]
        assert r.status == 400 and err["param"] == "prediction", (bad, err)


def test_speculative_decoding_metrics_in_vllms_shape(app):
    a, _ = app
    for body in (COMPLETION, {**COMPLETION, "stream": True}):
        r = _post(a, "/v1/completions", {**body, "strategy": "speculative", "options": {"k": 3}})
        out = r.json() if not body.get("stream") else r.sse_chunks()[-1]
        m, st = out["metrics"]["speculative_decoding"], out["specserve"]["stats"]
        assert m["num_drafts"] == st["steps"] > 0 and m["num_draft_tokens"] == st["drafted_tokens"] <= 3 * st["steps"]
        assert m["mean_acceptance_length"] == pytest.approx(1 + st["accepted_tokens"] / st["steps"])
        assert m["draft_acceptance_rate"] == pytest.approx(st["accepted_tokens"] / st["drafted_tokens"])
        assert sum(m["acceptance_histogram"]) == m["num_drafts"]
        assert sum(n * c for n, c in enumerate(m["acceptance_histogram"])) == m["num_accepted_tokens"]
    ar = _post(a, "/v1/completions", {**COMPLETION, "strategy": "autoregressive"}).json()
    assert ar["metrics"]["speculative_decoding"]["num_drafts"] == 0
    assert ar["metrics"]["speculative_decoding"]["mean_acceptance_length"] is None


def test_speculative_decoding_of_stats():
    from cluster.core.stats import RequestStats
    st = RequestStats()
    for drafted, accepted in ((4, 4), (4, 1), (4, 0)):
        st.verification(drafted, accepted)
    m = speculative_decoding(st)
    assert m["mean_acceptance_length"] == pytest.approx(1 + 5 / 3) and m["draft_acceptance_rate"] == pytest.approx(5 / 12)
    assert m["acceptance_histogram"] == [1, 1, 0, 0, 1] and m["acceptance_rate_per_pos"] == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])


def test_prediction_text_joins_text_parts():
    assert prediction_text({"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}) == "ab"
    assert prediction_text(None) is None
    with pytest.raises(ParamError, match="prediction"):
        prediction_text({"type": "content", "content": None})


# -- chat_template_kwargs ------------------------------------------------------------------------------
THINKING = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% endif %}{% endif %}")


def test_template_kwargs_reach_the_template_and_unread_ones_have_no_effect(tmp_path):
    write_word_tokenizer(tmp_path, 16)
    (tmp_path / "chat_template.jinja").write_text(THINKING)
    tok = HFTokenizer(tmp_path)
    plain = "<user>def main():<assistant>"
    assert render_chat(tok, MESSAGES) == plain
    assert render_chat(tok, MESSAGES, template_kwargs={"enable_thinking": False}) == plain + "<think></think>"
    assert render_chat(tok, MESSAGES, template_kwargs={"enable_thinking": True}) == plain
    # a switch this template does not read (misspelt, or another model's) is accepted and changes nothing, as on vLLM
    assert render_chat(tok, MESSAGES, template_kwargs={"enable_thinkng": False, "reasoning_effort": 3}) == plain
    for bad, words in (({"add_generation_prompt": False}, ["add_generation_prompt", "the server sets"]),
                       ({"raise_exception": 1}, ["raise_exception"]),
                       ({"enable_thinking": "false"}, ["enable_thinking: true or false", "'false'"]),
                       ({"enable_thinking": 0}, ["enable_thinking: true or false"])):
        with pytest.raises(ParamError) as e:
            render_chat(tok, MESSAGES, template_kwargs=bad)
        assert e.value.name == "chat_template_kwargs" and all(w in str(e.value) for w in words), (bad, str(e.value))


def test_template_variables_are_typed_by_how_the_template_uses_them(tmp_path):
    from cluster.models.chat_template import expected_type, template_uses
    template = ("{% if a %}{% endif %}{% if b is defined and b is false %}{% endif %}{% if c == 'high' or not c %}"
                "{% endif %}{{ d }}{% if d %}{% endif %}{{ e if f else '' }}{% if g == 1 %}{% endif %}"
                "{% for m in messages %}{{ m }}{% endfor %}")
    uses = template_uses(template)
    assert {n: expected_type(u) for n, u in uses.items()} == {
        "a": bool, "b": bool, "c": str, "d": None, "e": None, "f": bool, "g": None, "messages": None}
    assert template_uses("{% if %}") is None                       # not parsed here: the template decides
    write_word_tokenizer(tmp_path, 16)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}{% if effort == 'high' %}!{% endif %}")
    tok = HFTokenizer(tmp_path)
    assert render_chat(tok, MESSAGES, template_kwargs={"effort": "high"}) == "def main():!"
    with pytest.raises(ParamError, match="effort: a string"):
        render_chat(tok, MESSAGES, template_kwargs={"effort": 2})


def test_chat_template_kwargs_over_http(app):
    a, _ = app
    plain = _post(a, "/v1/chat/completions", CHAT).json()
    same = _post(a, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {}}).json()
    assert same["specserve"]["token_ids"] == plain["specserve"]["token_ids"]
    # the tiny models' template reads no switch: an agent framework's enable_thinking is accepted, and changes nothing
    unread = _post(a, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert unread.status == 200 and unread.json()["specserve"]["token_ids"] == plain["specserve"]["token_ids"]
    for bad in ({"add_generation_prompt": False}, [1], {"x" * 65: 1}, {f"k{i}": 1 for i in range(17)},
                {"messages": []}, {"k": "x" * 5000}, {"k": float("nan")}):
        r = call(a, "POST", "/v1/chat/completions", body=json.dumps({**CHAT, "chat_template_kwargs": bad}).encode())
        err = r.json()["error"]
        assert r.status == 400 and err["param"] == "chat_template_kwargs", (bad, err)
    # on completions no template is rendered: only its neutral value, and another is refused naming it
    assert _post(a, "/v1/completions", {**COMPLETION, "chat_template_kwargs": {}}).status == 200
    r = _post(a, "/v1/completions", {**COMPLETION, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    # every other unknown field is still refused by name
    r = _post(a, "/v1/chat/completions", {**CHAT, "enable_thinking": False})
    assert r.status == 400 and r.json()["error"]["param"] == "enable_thinking"


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_cache_salt_is_accepted_and_bad_ones_are_400_naming_it(app, path, base):
    """vLLM's ``cache_salt`` on both endpoints: a salt changes what is shared across requests, never the output;
    a salt that is not text of 1 to 256 characters is a 400 naming it, its range and the value."""
    a, _ = app
    plain = _post(a, path, base).json()
    for salt in ("tenant-a", "t" * 256, None):
        r = _post(a, path, {**base, "cache_salt": salt})
        assert r.status == 200 and r.json()["specserve"]["token_ids"] == plain["specserve"]["token_ids"], salt
    for bad in ("", "t" * 257, 5, ["a"], {"a": 1}):
        r = _post(a, path, {**base, "cache_salt": bad})
        err = r.json()["error"]
        assert r.status == 400 and err["param"] == "cache_salt" and "256 characters" in err["message"], (bad, err)


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_resume_token_ids_continue_a_request_exactly_and_bad_ones_are_400(app, path, base):
    """``resume_token_ids`` on both endpoints: the tokens an earlier run emitted; the answer is the whole request's
    (its ids, text and usage), equal to the uninterrupted one (greedy: cut anywhere; a sampled request is cut at a
    chunk boundary, tests/engine/test_resume.py)."""
    a, _ = app
    body = dict(base)
    whole = _post(a, path, body).json()
    ids = whole["specserve"]["token_ids"]
    got = _post(a, path, {**body, "resume_token_ids": ids[:9]}).json()
    assert got["specserve"]["token_ids"] == ids and got["usage"]["completion_tokens"] == len(ids)
    assert got["choices"][0] == whole["choices"][0]
    for bad, said in ((ids, "fewer token ids than the 24 new tokens"), ([-1], "token ids in"), ("1,2", "resume_token_ids")):
        r = _post(a, path, {**body, "resume_token_ids": bad})
        err = r.json()["error"]
        assert r.status == 400 and err["param"] == "resume_token_ids" and said in err["message"], (bad, err)
    r = _post(a, path, {**body, "temperature": 0.8, "seed": None, "resume_token_ids": ids[:2]})
    assert r.status == 400 and r.json()["error"]["param"] == "seed"
