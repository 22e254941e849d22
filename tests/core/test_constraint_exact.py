"""Constrained decoding is exact under every lossless strategy: with a grammar (a DFA over 4 tokens,
tests/support/grammar.py), speculative sampling (token and block verification), Max-Gram, CS Drafting
(lossy reviews below the target), SpecDec++ and autoregressive decoding emit exactly the law of constrained
autoregressive sampling from the target (its logits masked, then temperature / top-k / top-p), alone and
batched with unconstrained requests, by exact enumeration of every random draw (cluster/core/constraint.py).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cluster.core.constraint import constrain_rows, mask_logits, valid_prefix
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError
from cluster.models.maxgram import MagHandle
from cluster.strategies import resolve_options
from tests.support.adaptive import AdaptiveTabular
from tests.support.exact import (
    local_engine,
    TabularModel,
    VocabTokenizer,
    enumerate_outcomes,
    marginal,
    max_abs_diff,
    product,
    steps_law,
    target_joint,
)
from tests.support.grammar import V, DfaConstraint, DfaGrammar, constrained_joint, valid


def _models(seed: int) -> dict:
    return {"target": TabularModel("target", V, seed=seed),
            "large": TabularModel("large", V, seed=seed + 100, zeros=True),
            "small": TabularModel("small", V, seed=seed + 200, zeros=True),
            # bigram 0->1->2->0, 3->3: proposes forbidden transitions often, so the cut is exercised
            "mag": MagHandle(V, np.array([1, 2, 0, 3])),
            "adaptive": AdaptiveTabular("adaptive", V, seed=seed + 300, accept=0.9, zeros=True)}


CASES = [   # strategy, options, sampling, budget per step
    ("autoregressive", {}, SamplingParams(1.0), 1),
    ("speculative", dict(drafter="large", k=2), SamplingParams(1.0), 3),
    ("speculative", dict(drafter="large", k=3, verify="block"), SamplingParams(0.7), 4),
    ("speculative", dict(drafter="small", k=2), SamplingParams(1.2, top_k=2), 3),
    ("mag", dict(k=3), SamplingParams(1.0), 4),
    ("mag", dict(k=2, verify="block"), SamplingParams(0.8, top_p=0.9), 3),
    ("cs_drafting", dict(drafters="large,small,mag", kmatrix="1,0,0;0,1,0;0,0,2", lenience=2.5),
     SamplingParams(1.0), 4),
    ("cs_drafting", dict(drafters="small,mag", kmatrix="1,1;0,2"), SamplingParams(0.9, top_k=3), 4),
    ("specdec_pp", dict(drafter="adaptive", k_max=3, threshold=0.5), SamplingParams(1.0), 4),
]


@pytest.mark.parametrize("strategy,options,sampling,budget", CASES)
def test_steps_emit_the_constrained_target_law(strategy, options, sampling, budget):
    models, prompt, n = _models(seed=len(strategy) + budget), [2, 0, 1], 3
    constrained = dataclasses.replace(sampling, constraint=DfaGrammar().start(len(prompt)))
    opts = resolve_options(strategy, options, {})
    got = steps_law(strategy, opts, models, "target", prompt, constrained, n, budget)
    want = constrained_joint(models["target"], prompt, n, sampling)
    assert max_abs_diff(got, want) < 1e-9
    assert all(valid(seq) for seq in got)
    # teeth: the grammar changes the law (the unconstrained target emits forbidden sequences)
    assert max_abs_diff(want, target_joint(models["target"], prompt, n, sampling)) > 1e-2


@pytest.mark.parametrize("overlap", [False, True])
def test_pre_drafted_blocks_stay_exact(overlap):
    """The draft side's pre-drafting (blocks drafted past the bonus guess) under a grammar."""
    models, prompt = _models(seed=3), [0]
    sampling = SamplingParams(1.0, constraint=DfaGrammar().start(1))
    got = steps_law("speculative", resolve_options("speculative", dict(drafter="large", k=2), {}), models,
                    "target", prompt, sampling, 3, 3, overlap=overlap)
    assert max_abs_diff(got, constrained_joint(models["target"], prompt, 3, SamplingParams(1.0))) < 1e-9


def test_batched_constrained_and_free_requests_are_exact_and_independent():
    """Through the engine's continuous batch: two constrained requests (speculative block, cs_drafting) and an
    unconstrained mag request share the models; each emits its own law, jointly independent."""
    models = _models(seed=11)
    reqs = [("a", [0, 1], 3, SamplingParams(1.0), "speculative", dict(drafter="large", k=2, verify="block"), True),
            ("b", [2], 2, SamplingParams(0.8), "cs_drafting", dict(drafters="small,mag", kmatrix="1,1;0,2"), True),
            ("c", [1, 1, 0], 2, SamplingParams(1.0), "mag", dict(k=2), False)]
    holder = {}

    def run(rng):
        holder["rng"] = models["large"].rng = models["small"].rng = rng
        engine = local_engine(models, VocabTokenizer(V), rng_factory=lambda seed: holder["rng"])
        seqs = [engine.add(GenerationRequest(prompt_ids=list(p), max_new_tokens=n, sampling=s, seed=0, strategy=st,
                                             options=o, request_id=rid, grammar=DfaGrammar() if g else None))
                for rid, p, n, s, st, o, g in reqs]
        while engine.has_work:
            engine.step()
        return tuple(tuple(s.chunks[-1].result.token_ids) for s in seqs)

    joint = enumerate_outcomes(run)
    want = [(constrained_joint if g else target_joint)(models["target"], p, n, s) for _, p, n, s, _, _, g in reqs]
    for i in range(len(reqs)):
        assert max_abs_diff(marginal(joint, i), want[i]) < 1e-9, reqs[i][0]
    assert max_abs_diff(joint, product(want)) < 1e-9


@pytest.mark.parametrize("strategy,options", [("speculative", dict(drafter="large", k=3)), ("mag", dict(k=4)),
                                              ("cs_drafting", dict(drafters="large,small,mag"))])
def test_greedy_equals_constrained_greedy_decoding(strategy, options):
    models = _models(seed=5)
    engine = local_engine(models, VocabTokenizer(V))

    def generate(name, opts):
        return engine.generate(GenerationRequest(prompt_ids=[1, 2, 0], max_new_tokens=12, seed=0, strategy=name,
                                                 options=opts, sampling=SamplingParams(0.0),
                                                 grammar=DfaGrammar())).token_ids
    plain = generate("autoregressive", {})
    assert valid(plain) and generate(strategy, options) == plain


def test_unconstrained_strategies_are_refused_naming_the_field():
    engine = local_engine(_models(seed=1), VocabTokenizer(V))
    with pytest.raises(ParamError) as e:
        engine.generate(GenerationRequest(prompt_ids=[0], max_new_tokens=2, strategy="lossy",
                                          options=dict(drafter="large"), grammar=DfaGrammar()))
    assert e.value.name == "response_format" and "speculative" in str(e.value)


def test_masking_helpers():
    c = DfaConstraint(1)
    logits = torch.zeros(3, V)
    rows = constrain_rows(c, [9], [0, 2], logits)                  # states 0 -> 1 -> 0
    assert torch.isinf(rows).tolist() == [[False, False, True, True], [True, False, False, False],
                                          [False, False, True, True]]
    assert valid_prefix(c, [9], [0, 1, 1, 0, 2]) == 3 and valid_prefix(None, [9], [0, 0]) == 2
    short = mask_logits(torch.zeros(6), torch.tensor([True, False]))   # a mask shorter than the vocabulary
    assert torch.isinf(short).tolist() == [False] + [True] * 5
