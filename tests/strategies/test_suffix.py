"""Strategy ``suffix`` and the suffix drafter at the bottom of CS Drafting: exactly the target's law by enumeration
(drafts from an earlier request's output), greedy outputs equal plain decoding on tiny models alone and batched, a
repeated prompt drafts from the answer it had, and a cache_salt keeps those drafts to its own requests."""
from __future__ import annotations

import pytest
import yaml

from cluster.core.calls import PrefillItem
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError
from cluster.models.suffix import SuffixHandle
from cluster.strategies import REGISTRY, resolve_options
from tests.support.exact import TabularModel, VocabTokenizer, enumerate_outcomes, local_engine, max_abs_diff, \
    target_joint

PROMPT = [0, 1, 0]
HISTORY = [[0, 1, 0, 2, 2, 1, 0, 1], [1, 0, 2, 2, 0]]       # earlier requests: "0 1 0" went on with "2 2 1 ..."


def _suffix(history=HISTORY, salt: str = "") -> SuffixHandle:
    """A fresh suffix drafter that has seen ``history`` (prefilled and released, as finished requests are)."""
    h = SuffixHandle(3, max_depth=6, min_prob=0.0, spec_factor=4.0)
    for i, ids in enumerate(history):
        h.prefill_batch([PrefillItem(f"past-{i}", ids, SamplingParams(1.0), 0, salt)])
        h.release(f"past-{i}")
    return h


def _law(strategy: str, options: dict, sampling, n: int, *, extra=(), salt=None, history_salt=""):
    """The exact law of the first ``n`` tokens of ``PROMPT`` under ``strategy`` (every draw enumerated; a fresh
    drafter with the same history per path, as its index learns from each run), and whether any path drafted."""
    target = TabularModel("target", 3, seed=11)
    holder, drafted = {}, []

    def run(rng):
        holder["rng"] = rng
        models = {"target": target, **{m.name: m for m in extra}, "suffix": _suffix(salt=history_salt)}
        for m in extra:
            m.rng = rng
        engine = local_engine(models, VocabTokenizer(3), rng_factory=lambda s: holder["rng"])
        res = engine.generate(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=n, sampling=sampling, seed=0,
                                                strategy=strategy, options=options, cache_salt=salt))
        drafted.append(res.stats.drafted_tokens)
        return tuple(res.token_ids)

    return enumerate_outcomes(run), target_joint(target, PROMPT, n, sampling), sum(drafted)


@pytest.mark.parametrize("verify,sampling", [("token", SamplingParams(1.0)), ("block", SamplingParams(1.0)),
                                             ("token", SamplingParams(0.8, top_k=2))])
def test_suffix_is_exactly_the_targets_law(verify, sampling):
    got, want, drafted = _law("suffix", {"k": 3, "verify": verify}, sampling, 4)
    assert drafted > 0 and max_abs_diff(got, want) < 1e-9


def test_cs_drafting_over_the_suffix_drafter_is_exactly_the_targets_law():
    """A lossy neural reviewer (lenience 2) over the suffix drafter's one-hot drafts: exact at the target."""
    large = TabularModel("large", 3, seed=12, zeros=True)
    got, want, drafted = _law("cs_drafting", dict(drafters="large,suffix", kmatrix="1,1;0,3", lenience=2.0),
                              SamplingParams(1.0), 3, extra=(large,))
    assert drafted > 0 and max_abs_diff(got, want) < 1e-9


def test_a_salted_history_drafts_for_its_salt_only():
    _, _, same = _law("suffix", {"k": 3}, SamplingParams(1.0), 3, salt="t", history_salt="t")
    _, _, other = _law("suffix", {"k": 3}, SamplingParams(1.0), 3, salt="u", history_salt="t")
    _, _, unsalted = _law("suffix", {"k": 3}, SamplingParams(1.0), 3, history_salt="")
    assert same == unsalted > other


@pytest.fixture(scope="module")
def engine():
    from cluster.config.schema import config_from_dict
    from tests.support.built import engine_for
    data = yaml.safe_load(open("configs/tiny.yaml"))
    data["mag"], data["suffix"] = {}, {}
    return engine_for(config_from_dict(data))


PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "for i in range(10):\n    print(i)\n"]


def _req(prompt, strategy="suffix", salt=None, **options):
    return GenerationRequest(prompt=prompt, max_new_tokens=24, sampling=SamplingParams(0.0), seed=0, ignore_eos=True,
                             strategy=strategy, options=options, cache_salt=salt)


def test_greedy_equals_plain_decoding_and_a_repeated_prompt_drafts_from_its_answer(engine):
    for prompt in PROMPTS:
        want = engine.generate(_req(prompt, "autoregressive")).token_ids
        first = engine.generate(_req(prompt, salt=f"first-{prompt}"))
        again = engine.generate(_req(prompt, salt=f"first-{prompt}", k=16))
        assert first.token_ids == again.token_ids == want
        assert again.stats.accepted_tokens >= len(want) // 2 > first.stats.accepted_tokens
        for k in (1, 4):
            assert engine.generate(_req(prompt, k=k)).token_ids == want
    batch = [_req(p, salt=s) for p in PROMPTS for s in (None, "x")]
    assert [r.token_ids for r in engine.generate_many(batch)] == \
        [engine.generate(_req(p, "autoregressive")).token_ids for p in PROMPTS for _ in (None, "x")]
    assert all(not m.active_requests() for m in engine.models.values())


def test_a_hit_never_crosses_cache_salts(engine):
    """Greedy is deterministic: under a salt no request used, a prompt drafts as it did the very first time, however
    often another salt has seen it."""
    prompt = "import os\nimport sys\n\ndef main():\n"
    first = engine.generate(_req(prompt, salt="tenant-a", k=16)).stats
    again = engine.generate(_req(prompt, salt="tenant-a", k=16)).stats
    other = engine.generate(_req(prompt, salt="tenant-b", k=16)).stats
    assert again.accepted_tokens > first.accepted_tokens
    assert (other.drafted_tokens, other.accepted_tokens) == (first.drafted_tokens, first.accepted_tokens)


def test_cs_drafting_with_the_suffix_drafter_at_the_bottom(engine):
    for prompt in PROMPTS:
        want = engine.generate(_req(prompt, "autoregressive")).token_ids
        for _ in range(2):                                     # the second time its answer is in the index
            res = engine.generate(_req(prompt, "cs_drafting", salt="cs", drafters="drafter-small,suffix",
                                       kmatrix="2,4;0,4"))
            assert res.token_ids == want
        assert res.stats.drafter_forwards.get("suffix", 0) > 0
    with pytest.raises(ParamError, match="suffix drafter last only"):
        engine.generate(_req(PROMPTS[0], "cs_drafting", drafters="suffix,mag", kmatrix="1,1;0,1"))
    cs = REGISTRY["cs_drafting"](resolve_options("cs_drafting", {}, {}), engine.models, engine.target)
    assert cs.names[-1] == "mag"                               # the default bottom stays Max-Gram


def test_each_strategy_finds_its_own_statistical_drafter(engine):
    models = {"target": engine.models["target"], "suffix": engine.models["suffix"], "mag": engine.models["mag"]}
    assert REGISTRY["mag"](resolve_options("mag", {}, {}), models, "target").drafter == "mag"
    assert REGISTRY["suffix"](resolve_options("suffix", {}, {}), models, "target").drafter == "suffix"
    with pytest.raises(ParamError, match="`suffix:` section"):
        REGISTRY["suffix"](resolve_options("suffix", {}, {}), {"target": models["target"], "mag": models["mag"]},
                           "target")
    with pytest.raises(ParamError, match="`mag:` section"):
        REGISTRY["mag"](resolve_options("mag", {}, {}), {"target": models["target"], "suffix": models["suffix"]},
                        "target")
