"""Engine behaviour on real (tiny, random) HF models: greedy equality, rollback, seeds, stops, release."""
import pytest
import torch

from cluster.core.draft.programs import DRAFTS
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError
from tests.support.exact import TabularModel, VocabTokenizer
from tests.support.tolerance import FORWARD_ATOL
from tests.support.exact import local_engine

PROMPTS = ["def fibonacci(n):\n", "import os\nclass ", "x = [i * i for i in"]


def _gen(engine, prompt, strategy, seed=0, temperature=0.0, max_new=40, **options):
    return engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=max_new, seed=seed,
                                             sampling=SamplingParams(temperature), strategy=strategy,
                                             options=options, ignore_eos=True))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_autoregressive(tiny_engine, prompt):
    ref = _gen(tiny_engine, prompt, "autoregressive").token_ids
    assert len(ref) == 40
    for drafter in ("drafter-large", "drafter-small"):
        for k in (1, 3, 5):
            res = _gen(tiny_engine, prompt, "speculative", drafter=drafter, k=k)
            assert res.token_ids == ref, (drafter, k)


def test_stats_are_consistent(tiny_engine):
    res = _gen(tiny_engine, PROMPTS[0], "speculative", temperature=1.0, seed=3, k=4, max_new=60)
    s = res.stats
    assert res.finish_reason == "length" and s.generated_tokens == 60
    # each target forward emits its accepted drafts + 1 token; the ones that verify no draft (the target-only
    # first step, a last step whose budget leaves no room to draft) are not verification steps
    assert s.generated_tokens == s.accepted_tokens + s.target_forwards
    assert s.steps < s.target_forwards <= s.steps + 2 and sum(s.accepted_hist) == s.steps
    assert sum(s.drafter_forwards.values()) == s.drafted_tokens
    assert s.accepted_per_pos[0] == sum(s.accepted_hist[1:])       # position 1 accepted iff n >= 1
    assert all(a <= d for a, d in zip(s.accepted_per_pos, s.drafted_per_pos))
    assert 0 < s.accepted_tokens < s.drafted_tokens                # exercises accept and reject paths


def test_kv_rollback_matches_fresh_prefill(tiny_engine):
    w = tiny_engine.models["target"]
    sp = SamplingParams(1.0)
    prompt = list(b"def rollback(x):\n    return")
    w.prefill("a", prompt, sp, 0)
    w.score("a", [10, 20, 30, 40, 50])                 # cache grows by the draft
    w.rollback("a", len(prompt) + 2)                   # keep two draft tokens
    w.extend("a", [60])
    after = w.score("a", [70, 80])
    w.prefill("b", prompt + [10, 20, 60], sp, 0)
    fresh = w.score("b", [70, 80])
    assert after.shape == fresh.shape == (3, w.vocab_size)
    torch.testing.assert_close(after, fresh, atol=FORWARD_ATOL, rtol=0)
    tokens, logits = w.propose("a", 3)                 # proposals after rollback follow fresh state
    w.rollback("b", len(prompt) + 3 + 2)
    w.extend("b", [])
    torch.testing.assert_close(logits[0], w.score("b", [])[0], atol=FORWARD_ATOL, rtol=0)
    w.release("a"), w.release("b")


def test_score_after_full_rollback_still_returns_all_rows(tiny_engine):
    """A rollback that keeps every scored token leaves nothing pending; score must still give L+1 rows."""
    w = tiny_engine.models["target"]
    sp = SamplingParams(1.0)
    prompt = list(b"class Cascade:")
    w.prefill("a", prompt, sp, 0)
    w.score("a", [10, 20])
    w.rollback("a", len(prompt) + 2)                   # the cache covers all tokens now
    again = w.score("a", [30, 40])
    w.prefill("b", prompt + [10, 20], sp, 0)
    torch.testing.assert_close(again, w.score("b", [30, 40]), atol=FORWARD_ATOL, rtol=0)
    assert again.shape[0] == 3
    w.release("a"), w.release("b")


@pytest.mark.parametrize("strategy", ["autoregressive", "speculative"])
def test_seeded_sampling_is_reproducible(tiny_engine, strategy):
    a = _gen(tiny_engine, PROMPTS[1], strategy, seed=42, temperature=1.0)
    b = _gen(tiny_engine, PROMPTS[1], strategy, seed=42, temperature=1.0)
    c = _gen(tiny_engine, PROMPTS[1], strategy, seed=43, temperature=1.0)
    assert a.token_ids == b.token_ids and a.seed == 42
    assert a.token_ids != c.token_ids


def test_stop_string_truncates_text_and_tokens(tiny_engine):
    full = _gen(tiny_engine, PROMPTS[2], "speculative", temperature=1.0, seed=5)
    start = next(i for i in range(8, len(full.text) - 3) if "\ufffd" not in full.text[i:i + 3])
    stop = full.text[start:start + 3]
    res = tiny_engine.generate(GenerationRequest(prompt=PROMPTS[2], max_new_tokens=40, seed=5, stop=(stop,),
                                                 sampling=SamplingParams(1.0), strategy="speculative",
                                                 ignore_eos=True))
    assert res.finish_reason == "stop"
    assert res.text == full.text[:full.text.index(stop)]
    assert res.token_ids == full.token_ids[:len(res.token_ids)]
    assert stop in tiny_engine.tokenizer.decode(res.token_ids)
    assert stop not in tiny_engine.tokenizer.decode(res.token_ids[:-1])


def test_eos_ends_generation():
    vocab, eos = 4, 2

    class Tok(VocabTokenizer):
        eos_token_id = eos
    target = TabularModel("target", vocab, seed=1)
    drafter = TabularModel("drafter", vocab, seed=2)
    from cluster.core.sampling import Rng
    drafter.rng = Rng(0)
    engine = local_engine({"target": target, "drafter": drafter}, Tok(vocab))
    reasons = []
    for seed in range(20):
        res = engine.generate(GenerationRequest(prompt_ids=[0], max_new_tokens=30, seed=seed,
                                                sampling=SamplingParams(1.0), options={"k": 3}))
        assert eos not in res.token_ids
        if len(res.token_ids) < 30:
            assert res.finish_reason == "eos"
        reasons.append(res.finish_reason)
    assert "eos" in reasons
    assert target.seqs == {} and drafter.seqs == {}


def test_stream_concatenates_to_result_and_releases(tiny_engine):
    req = GenerationRequest(prompt=PROMPTS[0], max_new_tokens=30, seed=1, sampling=SamplingParams(1.0),
                            strategy="speculative", ignore_eos=True)
    chunks = list(tiny_engine.stream(req))
    result = chunks[-1].result
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert "".join(c.text for c in chunks) == result.text
    assert all(c.finish_reason is None for c in chunks[:-1]) and chunks[-1].finish_reason == "length"
    stream = tiny_engine.stream(req)
    next(stream)                                     # the target-only first step: the target holds it
    models = tiny_engine.models
    assert models[tiny_engine.target].active_requests() and not models[DRAFTS].active_requests()
    next(stream)                                     # then the draft side and the drafter it drafts with
    assert all(m.active_requests() for m in tiny_engine.models.values() if m.name != "drafter-small")
    stream.close()                                   # a cancelled stream frees every model's state
    assert all(not m.active_requests() for m in tiny_engine.models.values())


@pytest.mark.parametrize("field,kwargs,needle", [
    ("prompt", dict(prompt=""), "invalid prompt"),
    ("prompt_ids", dict(prompt_ids=[1, 99999]), "token ids in [0, 256]"),
    ("max_new_tokens", dict(prompt="x", max_new_tokens=0), "integer in [1, 512]"),
    ("max_new_tokens", dict(prompt="x", max_new_tokens=10**6), "integer in [1, 512]"),
    ("strategy", dict(prompt="x", strategy="nope"), "one of autoregressive"),
    ("k", dict(prompt="x", options={"k": 0}), "integer in [1, 64]"),
    ("drafter", dict(prompt="x", options={"drafter": "target"}), "one of drafter-large"),
    ("option", dict(prompt="x", strategy="autoregressive", options={"k": 2}), "options of strategy"),
    ("seed", dict(prompt="x", seed=-1), "integer in [0,"),
    ("stop", dict(prompt="x", stop=("",)), "strings of 1 to 64"),
    ("prompt", dict(prompt="y" * 1000, max_new_tokens=100), "at most 924 tokens"),
    ("cache_salt", dict(prompt="x", cache_salt=""), "text of 1 to 256 characters"),
    ("cache_salt", dict(prompt="x", cache_salt="s" * 257), "text of 1 to 256 characters"),
    ("cache_salt", dict(prompt="x", cache_salt=7), "text of 1 to 256 characters"),
    ("cache_salt", dict(prompt="x", cache_salt="\ud800"), "lone surrogate"),
])
def test_request_validation_names_parameter_range_and_value(tiny_engine, field, kwargs, needle):
    with pytest.raises(ParamError) as e:
        tiny_engine.prepare(GenerationRequest(**kwargs))
    assert e.value.name == field and needle in str(e.value)
    assert f"invalid {field}:" in str(e.value)


@pytest.mark.parametrize("kwargs,needle", [(dict(temperature=-0.5), "temperature"),
                                           (dict(top_p=0.0), "top_p"), (dict(top_p=1.2), "top_p"),
                                           (dict(top_k=-1), "top_k")])
def test_sampling_params_validation(kwargs, needle):
    with pytest.raises(ParamError, match=f"invalid {needle}"):
        SamplingParams(**kwargs)


class _Recording(TabularModel):
    """A tabular model that records the prefill items it is given (as PrefillItems: 4-tuples read unsalted)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.items = []

    def prefill_batch(self, items):
        from cluster.core.calls import PrefillItem
        self.items += [PrefillItem.of(it) for it in items]
        super().prefill_batch(items)


def test_cache_salt_reaches_every_models_prefill():
    """A request's cache_salt travels with its prefill to the target (plain and prompt-scoring prefill) and, through
    the draft side, to the drafter it drafts with; a request without one prefills unsalted ("")."""
    target, drafter = _Recording("target", 4, seed=1), _Recording("d", 4, seed=2)
    engine = local_engine({"target": target, "d": drafter}, VocabTokenizer(4))
    base = dict(prompt_ids=[0, 1, 2], max_new_tokens=6, sampling=SamplingParams(0.0), seed=0, strategy="speculative",
                options={"drafter": "d", "k": 2})
    assert engine.prepare(GenerationRequest(cache_salt="tenant-a", **base)).cache_salt == "tenant-a"
    salted = engine.generate(GenerationRequest(cache_salt="tenant-a", **base))
    assert {it.salt for it in target.items} == {"tenant-a"} == {it.salt for it in drafter.items}
    target.items.clear(), drafter.items.clear()
    engine.generate(GenerationRequest(cache_salt="tenant-b", prompt_logprobs=0, **base))   # prefill_scored
    assert {it.salt for it in target.items} == {"tenant-b"} == {it.salt for it in drafter.items}
    target.items.clear(), drafter.items.clear()
    plain = engine.generate(GenerationRequest(**base))
    assert {it.salt for it in target.items + drafter.items} == {""} and drafter.items
    assert plain.token_ids == salted.token_ids                   # a salt changes what is shared, never the output
