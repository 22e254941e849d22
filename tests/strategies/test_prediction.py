"""Predicted outputs keep every drafting strategy exact: the prediction decides only what is drafted.

Exact enumeration (tests/support/exact.py) of concurrent requests with and without a prediction, under
speculative (token and block verification), mag and cs_drafting, sampled and greedy: each request emits exactly
the target's law and the joint is the product (batching couples nothing); prediction-backed drafts were both
accepted and rejected on the enumerated paths, and both rules of cluster/core/prediction.py made blocks there
(the prediction's continuation alone, and a drafter's block -- sampled, sparse, or a cascade's -- extended by
it).  Greedy on the tiny real models: the output with any
prediction (the true output, an edited one, an unrelated one) equals the output without, alone and batched.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cluster.config.schema import MagSpec, load_config
from cluster.core.prediction import Prediction
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError
from cluster.models.maxgram import MagHandle
from tests.support.built import engine_for
from tests.support.exact import (
    local_engine,
    TabularModel,
    VocabTokenizer,
    enumerate_outcomes,
    marginal,
    max_abs_diff,
    product,
    target_joint,
)

V = 3
# pairs of concurrent requests: (prompt, new tokens, sampling, strategy, options, prediction text: letters A..
# are tokens 0..).  Short drafter blocks leave room in the budget for the prediction's continuation after them
CASES = [
    [([0, 1], 5, SamplingParams(1.0), "speculative", dict(drafter="d", k=1), "CBCB"),
     ([1, 1], 2, SamplingParams(1.0), "speculative", dict(drafter="d", k=2), None)],
    [([2, 1], 4, SamplingParams(0.8), "speculative", dict(drafter="d", k=1, verify="block"), "BCA"),
     ([1], 3, SamplingParams(1.0, top_k=2), "mag", dict(k=1), "ABA")],
    [([0], 4, SamplingParams(1.0), "cs_drafting", dict(drafters="d,mag", kmatrix="1,0;0,1", lenience=2.0), "ACAB"),
     ([2, 0], 3, SamplingParams(0.0), "mag", dict(k=1), "CABC")],
    # block verification alone, so its blocks extended by the prediction are the ones enumerated
    [([1], 4, SamplingParams(1.0), "speculative", dict(drafter="d", k=1, verify="block"), "ABAB")],
]


def _models(seed):
    return {"target": TabularModel("target", V, seed=seed), "d": TabularModel("d", V, seed=seed + 100, zeros=True),
            "mag": MagHandle(V, np.array([2, 0, 1]))}


def _joint(models, reqs, totals):
    holder = {}

    def run(rng):
        holder["rng"] = models["d"].rng = rng
        engine = local_engine(models, VocabTokenizer(V), rng_factory=lambda seed: holder["rng"])
        seqs = [engine.add(GenerationRequest(prompt_ids=list(p), max_new_tokens=n, sampling=s, seed=0, strategy=st,
                                             options=o, prediction=pred))
                for p, n, s, st, o, pred in reqs]
        while engine.has_work:
            engine.step()
        for s in seqs:
            assert s.error is None and s.finish == "length", s.error
            totals["drafted"] += s.stats.prediction_drafted
            totals["accepted"] += s.stats.prediction_accepted
        assert not any(m.active_requests() if hasattr(m, "active_requests") else m.seqs for m in models.values())
        return tuple(tuple(s.chunks[-1].result.token_ids) for s in seqs)

    return enumerate_outcomes(run)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_predicted_requests_are_exact_and_independent(case, monkeypatch):
    reqs, models = CASES[case], _models(case)
    totals = {"drafted": 0, "accepted": 0}
    used = {"lead": 0, "follow": 0}                           # blocks made by each rule on the enumerated paths
    for rule in used:
        def counted(self, *args, _rule=rule, _f=getattr(Prediction, rule)):
            out = _f(self, *args)
            used[_rule] += bool(out)
            return out
        monkeypatch.setattr(Prediction, rule, counted)
    joint = _joint(models, reqs, totals)
    want = [target_joint(models["target"], list(p), n, s) for p, n, s, *_ in reqs]
    for i, (_, _, _, strategy, _, pred) in enumerate(reqs):
        assert max_abs_diff(marginal(joint, i), want[i]) < 1e-9, (strategy, pred)
    assert max_abs_diff(joint, product(want)) < 1e-9
    assert 0 < totals["accepted"] < totals["drafted"]         # both paths of the prediction's drafts ran
    assert used["lead"] and used["follow"]       # blocks of the prediction alone, and drafter blocks it extended


def test_prediction_is_checked():
    engine = local_engine(_models(0), VocabTokenizer(V))
    for bad in ("", 7, ["A"], [3], [], [True], "A" * (64 * 32 + 1)):
        with pytest.raises(ParamError, match="prediction"):
            engine.prepare(GenerationRequest(prompt_ids=[0], max_new_tokens=2, strategy="mag", prediction=bad))


# -- greedy on the tiny real models ----------------------------------------------------------------
GREEDY = SamplingParams(0.0)
PROMPT = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n"
NEW = 40


@pytest.fixture(scope="module")
def engine():
    cfg = load_config("configs/tiny.yaml")
    return engine_for(dataclasses.replace(cfg, mag=MagSpec(),
                                          engine=dataclasses.replace(cfg.engine, max_batch=8, max_queue=32)))


VARIANTS = [("autoregressive", {}), ("speculative", dict(drafter="drafter-large", k=4)), ("mag", dict(k=3)),
            ("speculative", dict(drafter="drafter-small", k=3, verify="block")),
            ("cs_drafting", dict(drafters="drafter-small,mag", kmatrix="2,2;0,4"))]


def _requests(prompt, predictions):
    return [GenerationRequest(prompt=prompt, max_new_tokens=NEW, sampling=GREEDY, seed=0, strategy=s, options=o,
                              ignore_eos=True, prediction=pred) for s, o in VARIANTS for pred in predictions]


def test_greedy_output_is_unchanged_by_the_prediction_alone_and_batched(engine):
    ref = engine.generate(GenerationRequest(prompt=PROMPT, max_new_tokens=NEW, sampling=GREEDY, seed=0,
                                            strategy="autoregressive", ignore_eos=True))
    text = ref.token_ids                                   # the tiny models' bytes are not always UTF-8: ids
    edited = text[:10] + [120, 121] + text[14:]
    predictions = [None, text, edited, "while True:\n    pass\n" * 3]
    alone = [engine.generate(r) for r in _requests(PROMPT, predictions)]
    batched = engine.generate_many(_requests(PROMPT, predictions))
    for res in alone + batched:
        assert res.token_ids == ref.token_ids
    exact = [r for r, (_, pred) in zip(alone, [(v, p) for v in VARIANTS for p in predictions]) if pred == text]
    for r in exact:
        if r.stats.strategy != "autoregressive":          # the true output predicted: (almost) all of it drafted
            assert r.stats.prediction_accepted >= NEW // 2
            assert r.stats.target_forwards < NEW // 2
        else:                                             # a strategy that does not draft ignores it
            assert r.stats.prediction_drafted == 0
    assert any(0 < r.stats.prediction_accepted < r.stats.prediction_drafted for r in alone)   # edited: rejections
