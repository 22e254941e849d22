"""``engine.plain_from_batch``, the speculation policy's knob (cluster/engine/policy.py): from that many running
rows up, fixed-length drafting (speculative, cs_drafting) decodes plainly, and drafts again below it.  Exact:
request A runs alone (drafting) and B joins (two rows: plain), or both join together (A's drafters hold no state
until it first drafts); B leaves and A drafts again, its drafters caught up on (or prefilled with) the plain
steps' tokens -- the joint law of (A, B) is the product of the target's laws (exact enumeration, V = 3, to
1e-9).  Greedy: outputs equal plain decoding's, and at or above the threshold the drafters are never called."""
from __future__ import annotations

import pytest

from cluster.config.schema import EngineSpec
from cluster.core.sampling import SamplingParams
from cluster.engine.policy import SpeculationPolicy
from cluster.engine.request import GenerationRequest
from cluster.errors import ConfigError
from tests.support.exact import (TabularModel, VocabTokenizer, enumerate_outcomes, join_and_leave, joint_of_two,
                                 local_engine, max_abs_diff)


OPTIONS = {"speculative": {"drafter": "large", "k": 2},
           "cs_drafting": {"drafters": "large,small", "kmatrix": "1,1;0,2"}}


@pytest.mark.parametrize("strategy,steps_before", [
    ("speculative", 2), ("cs_drafting", 1),
    pytest.param("speculative", 0, marks=pytest.mark.slow)])     # ~30 s, both joining at once: the slow suite's
def test_plain_from_a_batch_size_is_exact_as_rows_join_and_leave(strategy, steps_before):
    target = TabularModel("target", 3, seed=21)
    drafters = TabularModel("large", 3, seed=22, zeros=True), TabularModel("small", 3, seed=23)
    holder = {}
    engine = local_engine({"target": target, "large": drafters[0], "small": drafters[1]}, VocabTokenizer(3),
                          rng_factory=lambda s: holder["rng"], policy=SpeculationPolicy(plain_from_batch=2))

    def run(rng):
        holder["rng"] = rng
        for d in drafters:
            d.rng = rng
        return join_and_leave(engine, dict(prompt_ids=[0], max_new_tokens=5, strategy=strategy,
                                           options=OPTIONS[strategy]),
                              dict(prompt_ids=[1], max_new_tokens=2, strategy=strategy, options=OPTIONS[strategy]),
                              steps_before)

    assert max_abs_diff(enumerate_outcomes(run), joint_of_two(target, ([0], 5), ([1], 2))) < 1e-9


@pytest.mark.parametrize("threshold,drafts", [(1, False), (3, True), (None, True)])
def test_greedy_outputs_equal_plain_decoding_and_the_drafters_rest_at_the_threshold(threshold, drafts):
    target, d = TabularModel("target", 5, seed=9), TabularModel("d", 5, seed=40)
    engine = local_engine({"target": target, "d": d}, VocabTokenizer(5),
                          policy=SpeculationPolicy(plain_from_batch=threshold))
    plain = local_engine({"target": TabularModel("target", 5, seed=9)}, VocabTokenizer(5))
    reqs = [dict(prompt_ids=p, max_new_tokens=n, sampling=SamplingParams(0.0), seed=0, request_id=f"r{i}")
            for i, (p, n) in enumerate((([1, 2], 30), ([3], 12), ([4, 0, 1], 20)))]
    got = engine.generate_many([GenerationRequest(strategy="speculative", options={"drafter": "d", "k": 4}, **q)
                                for q in reqs])
    want = plain.generate_many([GenerationRequest(strategy="autoregressive", **q) for q in reqs])
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert (d.forwards > 0) == drafts              # threshold 1: every step is plain, no drafter ever runs
    assert not d.seqs and not target.seqs


def test_the_threshold_is_validated_with_its_name():
    EngineSpec(plain_from_batch=16).validate("engine")
    with pytest.raises(ConfigError, match=r"engine\.plain_from_batch: must be in \[1, 4096\].*got 0"):
        EngineSpec(plain_from_batch=0).validate("engine")
