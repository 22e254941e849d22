"""The first token comes from the target's prefill alone (the speculation policy, cluster/engine/policy.py): a
lossless request's first step is target-only -- no drafter is prefilled or asked before it -- and its drafters
are prefilled at the first step it drafts.  A lossy strategy (a speculative cascade) and a request with a
predicted output draft from their first step.  Exactness of the switch is enumerated in test_plain_by_batch.py
(requests joining a running batch and together) and by every engine-level enumeration test."""
from __future__ import annotations

import numpy as np
from cluster.core.draft.programs import DRAFTS
from cluster.core.sampling import Rng, SamplingParams
from cluster.engine.policy import SpeculationPolicy
from cluster.engine.request import GenerationRequest
from cluster.models.maxgram import MagHandle
from tests.support.exact import TabularModel, VocabTokenizer, local_engine

V = 4


class Counting(TabularModel):
    """A tabular drafter that counts its prefills and proposals."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def prefill(self, rid, ids, sampling, seed):
        self.calls.append(("prefill", len(ids)))
        super().prefill(rid, ids, sampling, seed)

    def propose(self, rid, k):
        self.calls.append(("propose", k))
        return super().propose(rid, k)


def _engine(policy=SpeculationPolicy()):
    models = {"target": TabularModel("target", V, seed=1), "d": Counting("d", V, seed=2, rng=Rng(5)),
              "mag": MagHandle(V, np.array([1, 2, 3, 0]))}
    return local_engine(models, VocabTokenizer(V), policy=policy), models


def _req(strategy, n=6, **kw):
    return GenerationRequest(prompt_ids=[0, 1, 2], max_new_tokens=n, sampling=SamplingParams(1.0), seed=3,
                             strategy=strategy, **kw)


def test_first_step_is_the_targets_alone_then_the_drafter_is_prefilled_with_the_first_token():
    engine, models = _engine()
    seq = engine.add(_req("speculative", options={"drafter": "d", "k": 3}))
    engine.step()
    assert len(seq.generated) == 1 and seq.stats.target_forwards == 1 and seq.stats.drafted_tokens == 0
    assert models["d"].calls == [] and not engine.models[DRAFTS].active_requests()
    engine.step()
    assert models["d"].calls[0] == ("prefill", 3 + 1)       # the prompt and the first token
    assert len(seq.generated) >= 2 and seq.stats.drafted_tokens > 0 and not seq.stale


def test_a_one_token_request_never_touches_the_drafter():
    engine, models = _engine()
    res = engine.generate(_req("speculative", n=1, options={"drafter": "d", "k": 3}))
    assert len(res.token_ids) == 1 and models["d"].calls == [] and not engine.has_work


def test_a_cascade_and_a_predicted_request_draft_from_their_first_step():
    engine, models = _engine()
    cascade = engine.add(_req("spec_cascade", options={"drafter": "d", "k": 2}))
    predicted = engine.add(_req("mag", options={"k": 2}, prediction="DABCD"))
    plain = engine.add(_req("mag", options={"k": 2}))
    engine.step()
    assert ("prefill", 3) in models["d"].calls and ("propose", 2) in models["d"].calls   # the cascade's drafter
    assert predicted.stats.prediction_drafted > 0 and not predicted.stale
    assert plain.stats.drafted_tokens == 0 and plain.stale == {DRAFTS}
    assert sorted(engine.models[DRAFTS].active_requests()) == [predicted.rid]


def test_a_request_the_batch_keeps_plain_prefills_its_drafter_only_when_it_first_drafts():
    """While the speculation policy keeps a request plain (here: two running rows with ``plain_from_batch=2``)
    it decodes with no drafter state at all (no prefill, nothing on the draft side); at the first step it drafts
    (the other row has left) its drafter is prefilled with every committed token and drafts at once; greedy
    tokens equal plain decoding's."""
    engine, models = _engine(SpeculationPolicy(plain_from_batch=2))
    greedy = dict(prompt_ids=[0, 1, 2], sampling=SamplingParams(0.0), seed=3)
    seq = engine.add(GenerationRequest(max_new_tokens=8, strategy="speculative",
                                       options={"drafter": "d", "k": 3}, **greedy))
    other = engine.add(GenerationRequest(max_new_tokens=3, strategy="autoregressive", **greedy))
    for _ in range(3):                                  # the first step (target-only), then two plain in a batch of 2
        engine.step()
    assert len(seq.generated) == 3 and models["d"].calls == [] and seq.stale == {DRAFTS}
    assert not engine.models[DRAFTS].active_requests() and other.finish == "length"
    engine.step()                                       # alone: prefilled with prompt + 3 tokens, then drafts
    assert models["d"].calls[0] == ("prefill", 3 + 3) and not seq.stale and seq.stats.drafted_tokens == 3
    while engine.has_work:
        engine.step()
    plain, _ = _engine()
    want = plain.generate(GenerationRequest(max_new_tokens=8, strategy="autoregressive", **greedy)).token_ids
    assert seq.generated == list(want)
