"""Exact enumeration through the scheduler: several concurrent requests, mixed strategies, options,
temperatures and ragged prompts in one continuous batch.

One :class:`EnumRng` drives every random source (each request's engine rng and the tabular drafters'
own ``rng``), so the enumeration covers the joint law of all requests' outputs.  Each request must emit
exactly its strategy's law (the target's for lossless strategies, the stated pi for lossy ones), and
the joint must be the product of those laws: batching neither biases a request nor couples two.
"""
from __future__ import annotations

import numpy as np
import pytest

from cluster.core.cascade_targets import cascade_target, lossy_target
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.engine.scheduler import Limits
from cluster.models.maxgram import MagHandle
from tests.support.exact import (
    TabularModel,
    VocabTokenizer,
    enumerate_outcomes,
    local_engine,
    marginal,
    max_abs_diff,
    pi_joint,
    product,
    target_joint,
)

V = 3
TARGET = "target"                 # expected law: the (processed) target's autoregressive joint


def _lossy(alpha):
    return lambda q, p, qr, pr: lossy_target(q, p, alpha)


def _cascade(rule, alpha):
    return lambda q, p, qr, pr: cascade_target(q, p, rule, alpha, qr, pr)


# (request id, prompt, new tokens, sampling, strategy, options, expected law, steps before it is added)
CASES = {
    "lossless_token_block_ar": (Limits(), [
        ("a", [0], 2, SamplingParams(1.0), "speculative", dict(drafter="d", k=2), TARGET, 0),
        ("b", [2, 1, 0, 1], 2, SamplingParams(0.7), "speculative", dict(drafter="d", k=2, verify="block"), TARGET, 0),
        ("c", [1, 2], 2, SamplingParams(1.3, top_k=2), "autoregressive", {}, TARGET, 0),
    ]),
    "mag_csd_lossy": (Limits(), [
        ("a", [0, 1, 2, 0], 2, SamplingParams(1.0), "mag", dict(k=2), TARGET, 0),
        ("b", [1], 2, SamplingParams(0.8), "cs_drafting",
         dict(drafters="small,mag", kmatrix="1,1;0,2", lenience=2.0), TARGET, 0),
        ("c", [2, 2, 0], 2, SamplingParams(1.0), "lossy", dict(drafter="d", k=2, alpha=0.4), _lossy(0.4), 0),
    ]),
    # batch of two: "c" waits for a place; "e" arrives after the first step and queues behind it
    "queued_late_arrival": (Limits(max_batch=2), [
        ("a", [0, 2], 3, SamplingParams(0.8), "spec_cascade", dict(drafter="d", k=3, rule="opt", alpha=0.2),
         _cascade("opt", 0.2), 0),
        ("b", [1, 0, 2, 2, 1], 3, SamplingParams(0.0), "speculative", dict(drafter="d", k=3), TARGET, 0),
        ("c", [2], 2, SamplingParams(1.0, top_p=0.8), "mag", dict(k=1, verify="block"), TARGET, 0),
        ("e", [1, 1, 0], 2, SamplingParams(1.0, top_k=2), "autoregressive", {}, TARGET, 1),
    ]),
}


def _models(seed):
    target = TabularModel("target", V, seed=seed)
    d = TabularModel("d", V, seed=seed + 100, zeros=True)
    small = TabularModel("small", V, seed=seed + 200, zeros=True)
    mag = MagHandle(V, np.array([2, 0, 1]))
    return {"target": target, "d": d, "small": small, "mag": mag}


def _expected(models, prompt, n, sampling, law):
    if law == TARGET:
        return target_joint(models["target"], list(prompt), n, sampling)
    return pi_joint(models["target"], models["d"], list(prompt), n, sampling, law)


def _joint(models, limits, reqs):
    """Exact joint law of every request's tokens, all driven by engine.step() through the scheduler."""
    holder = {}
    seen = {"max_running": 0, "waited": False}

    def run(rng):
        holder["rng"] = models["d"].rng = models["small"].rng = rng
        engine = local_engine(models, VocabTokenizer(V), rng_factory=lambda seed: holder["rng"], limits=limits)
        seqs, steps = {}, 0
        while len(seqs) < len(reqs) or engine.has_work:
            for rid, prompt, n, sampling, strategy, options, _, late in reqs:
                if rid not in seqs and late <= steps:
                    seqs[rid] = engine.add(GenerationRequest(
                        prompt_ids=list(prompt), max_new_tokens=n, sampling=sampling, seed=0, strategy=strategy,
                        options=options, request_id=rid))
            engine.step()
            steps += 1
            running = len(engine.scheduler.running)
            assert running <= limits.max_batch
            seen["max_running"] = max(seen["max_running"], running)
            seen["waited"] |= any(s.status == "waiting" for s in seqs.values())
        for h in models.values():                       # every request released its state everywhere
            assert not (h.seqs if isinstance(h, TabularModel) else h.active_requests())
        out = []
        for rid, *_ in reqs:
            seq = seqs[rid]
            assert seq.error is None and seq.finish == "length", (rid, seq.error)
            out.append(tuple(seq.chunks[-1].result.token_ids))
        return tuple(out)

    return enumerate_outcomes(run), seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_concurrent_requests_are_exact_and_independent(case):
    limits, reqs = CASES[case]
    models = _models(seed=sorted(CASES).index(case))
    joint, seen = _joint(models, limits, reqs)
    want = [_expected(models, prompt, n, sampling, law) for _, prompt, n, sampling, _, _, law, _ in reqs]
    for i, (rid, prompt, n, sampling, strategy, _, law, _) in enumerate(reqs):
        got = marginal(joint, i)
        assert max_abs_diff(got, want[i]) < 1e-9, (rid, strategy)
        if law != TARGET:          # the stated pi is not the target's law here: the check has teeth
            assert max_abs_diff(got, target_joint(models["target"], list(prompt), n, sampling)) > 1e-3
    assert max_abs_diff(joint, product(want)) < 1e-9        # independent requests
    assert len(joint) == np.prod([len(w) for w in want])
    if limits.max_batch < len(reqs):
        assert seen["max_running"] == limits.max_batch and seen["waited"]
    else:
        assert seen["max_running"] == len(reqs)


def test_generate_many_is_exact_and_independent():
    """The same through generate_many (all requests join in one step; vocabulary 3, two requests of the
    same strategy sharing the drafter, one with block verification)."""
    models = _models(seed=7)
    reqs = [("x", [0, 1], 3, SamplingParams(1.0), dict(k=2)),
            ("y", [2, 2, 2, 1, 0, 1], 2, SamplingParams(0.6, top_k=2), dict(k=1, verify="block"))]
    holder = {}

    def run(rng):
        holder["rng"] = models["d"].rng = rng
        engine = local_engine(models, VocabTokenizer(V), rng_factory=lambda seed: holder["rng"])
        res = engine.generate_many([GenerationRequest(prompt_ids=p, max_new_tokens=n, sampling=s, seed=i,
                                                      strategy="speculative", options=dict(drafter="d", **o),
                                                      request_id=rid)
                                    for i, (rid, p, n, s, o) in enumerate(reqs)])
        return tuple(tuple(r.token_ids) for r in res)

    joint = enumerate_outcomes(run)
    want = [target_joint(models["target"], p, n, s) for _, p, n, s, _ in reqs]
    for i in range(len(reqs)):
        assert max_abs_diff(marginal(joint, i), want[i]) < 1e-9
    assert max_abs_diff(joint, product(want)) < 1e-9
