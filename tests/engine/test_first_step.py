"""The first token comes from the target's prefill alone (cluster.engine.prefill): a lossless request's first
step is target-only -- no drafter is prefilled or asked before it -- and its drafters are prefilled at the next
step, from which it drafts.  A lossy strategy (a speculative cascade) and a request with a predicted output
draft from their first step.  Exactness of the switch is enumerated in test_planned_exact.py (a speculative
request joining a running batch) and by every engine-level enumeration test."""
from __future__ import annotations

import numpy as np
from cluster.core.draft.programs import DRAFTS
from cluster.core.sampling import Rng, SamplingParams
from cluster.engine.planner import is_planned
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


def _engine():
    models = {"target": TabularModel("target", V, seed=1), "d": Counting("d", V, seed=2, rng=Rng(5)),
              "mag": MagHandle(V, np.array([1, 2, 3, 0]))}
    return local_engine(models, VocabTokenizer(V)), models


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


class Plays:
    """A planner that plays ``ks`` (one per plan) to the load-aware requests that run their own step."""

    def __init__(self, ks):
        self.ks, self.i = list(ks), 0

    def plan(self, running, stuck=None):
        planned = [s for s in running if is_planned(s) and not (stuck and stuck(s))]
        for s in planned:
            s.ctx.planned_k = self.ks[min(self.i, len(self.ks) - 1)]
        self.i += bool(planned)

    def observe(self, seconds):
        pass

    def prefilled(self, seqs, seconds=0.0):
        pass


def test_a_planned_request_prefills_its_drafter_only_when_the_plan_drafts():
    """plan=load_aware: while the planner says k = 0 the request decodes plainly with no drafter state at all
    (no prefill, nothing on the draft side); the first step planned k > 0 prefills the drafter with every
    committed token and drafts at once; greedy tokens equal plain decoding's."""
    engine, models = _engine()
    engine.planner = Plays([0, 0, 2])
    seq = engine.add(GenerationRequest(prompt_ids=[0, 1, 2], max_new_tokens=8, sampling=SamplingParams(0.0),
                                       seed=3, strategy="speculative",
                                       options={"drafter": "d", "k": 3, "plan": "load_aware"}))
    for _ in range(3):                                  # the first step (target-only), then two planned k = 0
        engine.step()
    assert len(seq.generated) == 3 and models["d"].calls == [] and seq.stale == {DRAFTS}
    assert not engine.models[DRAFTS].active_requests()
    engine.step()                                       # k = 2: prefilled with prompt + 3 tokens, then drafts
    assert models["d"].calls[0] == ("prefill", 3 + 3) and not seq.stale and seq.stats.drafted_tokens == 2
    while engine.has_work:
        engine.step()
    plain, _ = _engine()
    want = plain.generate(GenerationRequest(prompt_ids=[0, 1, 2], max_new_tokens=8, sampling=SamplingParams(0.0),
                                            seed=3, strategy="autoregressive")).token_ids
    assert seq.generated == list(want)
