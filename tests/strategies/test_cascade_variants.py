"""The published variants of GenSpecSample's bonus token and of lossy speculative sampling's beta
(Narasimhan et al., *Faster Cascades via Speculative Decoding*), each enumerated exactly through the engine
with drafts shorter than the budget, so bonus tokens fall inside the emitted tokens."""
from collections import defaultdict

import numpy as np
import pytest
import torch

from cluster.core.cascade_targets import (
    cascade_target,
    lossy_target,
    lossy_target_fixed_beta,
)
from cluster.core.sampling import UNSCALED, SamplingParams, logits_to_probs
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError
from tests.strategies.test_cascade import _engine_dist as _cascade_dist
from tests.strategies.test_cascade import _models
from tests.support.exact import (
    VocabTokenizer,
    local_engine,
    max_abs_diff,
    pi_joint,
    random_dist,
    target_joint,
)

T1 = SamplingParams(1.0)
NEVER, ALWAYS = 1.0, -2.0


def _engine_dist(target, drafter, strategy, options, n, sampling=T1, sampler="batched"):
    return _cascade_dist(target, drafter, strategy, options, n, sampling, sampler)


@pytest.mark.parametrize("strategy,options,sampling", [
    ("spec_cascade", {"rule": "opt", "alpha": 0.2, "k": 2, "bonus": "pi"}, T1),
    ("spec_cascade", {"rule": "token_v1", "alpha": 0.1, "k": 1}, SamplingParams(0.7, top_k=2)),
    ("spec_cascade", {"rule": "chow", "alpha": 0.5, "k": 2, "bonus": "pi"}, SamplingParams(0.0)),
    ("lossy", {"alpha": 0.3, "k": 2, "beta": "solve", "bonus": "pi"}, T1),
    ("lossy", {"alpha": 0.3, "k": 1, "beta": 0.8}, SamplingParams(1.0, top_p=0.8)),
    ("oracle_cascade", {"rule": "diff", "alpha": 0.05}, T1),
    ("oracle_cascade", {"rule": "token_v2", "alpha": 0.2}, SamplingParams(0.0)),
    ("token_cascade", {"alpha": 0.4}, T1)])
def test_the_batched_sampler_emits_the_per_row_references_law(strategy, options, sampling):
    """Each lossy mode's law through the batched sampler (pi built on the target's device, GenSpecSample over
    the batch) equals its per-row float64 reference (``engine.sampler: reference``), greedy rows included."""
    target, drafter = _models(3, 11)
    got = _engine_dist(target, drafter, strategy, options, 3, sampling)
    want = _engine_dist(target, drafter, strategy, options, 3, sampling, sampler="reference")
    assert max_abs_diff(got, want) < 1e-9


def block_law(target, drafter, prompt, n, k, sampling, fn, bonus):
    """The law of ``n`` tokens from GenSpecSample steps of min(k, tokens left) drafts, written from the events
    of Algorithm 4: at a draft position the emitted token is x *accepted* with weight min(q, pi)(x) (the block
    goes on) or *recovered* with weight max(0, pi - q)(x) (the block ends); after the whole draft, a bonus
    token from p (``bonus="p"``) or pi (``"pi"``) ends it."""
    out: dict = defaultdict(float)

    def dists(seq):
        ql, pl = drafter.logits(prompt + seq), target.logits(prompt + seq)
        q, p = logits_to_probs(ql, sampling), logits_to_probs(pl, sampling)
        return q, p, fn(q, p, logits_to_probs(ql, UNSCALED), logits_to_probs(pl, UNSCALED))

    def block(seq, w):
        if len(seq) == n:
            out[tuple(seq)] += w
        else:
            walk(seq, w, min(k, n - len(seq)))

    def walk(seq, w, left):
        if len(seq) == n:
            out[tuple(seq)] += w
            return
        q, p, pi = dists(seq)
        if left == 0:
            for y, v in enumerate((p if bonus == "p" else pi).tolist()):
                if v > 0:
                    block(seq + [y], w * v)
            return
        for x in range(len(q)):
            acc, rec = min(float(q[x]), float(pi[x])), max(0.0, float(pi[x] - q[x]))
            if acc > 0:
                walk(seq + [x], w * acc, left - 1)
            if rec > 0:
                block(seq + [x], w * rec)

    block([], 1.0)
    return dict(out)


# -- bonus token: p (first version) vs pi (later version) -------------------------------------------

@pytest.mark.parametrize("rule,alpha,k,seed", [("chow", 0.5, 1, 0), ("diff", 0.05, 2, 1), ("token_v2", 0.2, 1, 2)])
def test_spec_cascade_bonus_pi_emits_the_pi_chain_for_any_k(rule, alpha, k, seed):
    """bonus=pi (Algorithm 4, later version): every emitted token follows pi, bonus positions included."""
    target, drafter = _models(3, seed)
    fn = lambda q, p, qr, pr: cascade_target(q, p, rule, alpha, qr, pr)
    got = _engine_dist(target, drafter, "spec_cascade", {"rule": rule, "alpha": alpha, "k": k, "bonus": "pi"}, 3)
    assert max_abs_diff(got, pi_joint(target, drafter, [0], 3, T1, fn)) < 1e-9
    assert max_abs_diff(got, block_law(target, drafter, [0], 3, k, T1, fn, "pi")) < 1e-9


@pytest.mark.parametrize("rule,alpha,k,seed", [("chow", 0.5, 1, 0), ("diff", 0.05, 2, 1), ("token_v2", 0.2, 1, 2)])
def test_spec_cascade_bonus_p_emits_the_block_law(rule, alpha, k, seed):
    """bonus=p (first version, the default): draft positions follow pi, bonus positions p -- and that law
    differs from the pi chain, so the two variants are told apart."""
    target, drafter = _models(3, seed)
    fn = lambda q, p, qr, pr: cascade_target(q, p, rule, alpha, qr, pr)
    got = _engine_dist(target, drafter, "spec_cascade", {"rule": rule, "alpha": alpha, "k": k}, 3)
    assert max_abs_diff(got, block_law(target, drafter, [0], 3, k, T1, fn, "p")) < 1e-9
    assert max_abs_diff(got, pi_joint(target, drafter, [0], 3, T1, fn)) > 1e-3


def test_bonus_pi_at_the_alpha_ends_is_drafter_and_target():
    """k = 1 < budget 3: with bonus=pi never deferring reproduces the drafter alone, always deferring the target."""
    target, drafter = _models(3, 8)
    never = _engine_dist(target, drafter, "spec_cascade", {"rule": "diff", "k": 1, "alpha": NEVER, "bonus": "pi"}, 3)
    always = _engine_dist(target, drafter, "spec_cascade", {"rule": "diff", "k": 1, "alpha": ALWAYS, "bonus": "pi"}, 3)
    assert max_abs_diff(never, target_joint(drafter, [0], 3)) < 1e-9
    assert max_abs_diff(always, target_joint(target, [0], 3)) < 1e-9
    bonus_p = _engine_dist(target, drafter, "spec_cascade", {"rule": "diff", "k": 1, "alpha": NEVER}, 3)
    assert max_abs_diff(bonus_p, target_joint(drafter, [0], 3)) > 1e-3     # p's bonus tokens show


def test_bonus_pi_costs_one_drafter_forward_per_full_acceptance(tiny_engine):
    """alpha = 1: pi = q, so every draft of 3 is accepted; 23 tokens = 5 steps of 3 + bonus, then a last draft of
    3 that fills the budget (no bonus).  bonus=pi pays one drafter forward for each of the 5 steps with room for
    a bonus token (drafted with the block through the batched sampler, after a full acceptance in the reference)."""
    req = dict(prompt="def f(x):", max_new_tokens=23, seed=4, sampling=SamplingParams(1.0), ignore_eos=True)
    for bonus, extra in (("p", 0), ("pi", 5)):
        res = tiny_engine.generate(GenerationRequest(strategy="spec_cascade", options=dict(
            rule="chow", alpha=NEVER, k=3, bonus=bonus), **req))
        s = res.stats
        assert len(res.token_ids) == 23 and s.steps == 6 and s.accepted_tokens == s.drafted_tokens == 18
        assert sum(s.drafter_forwards.values()) == s.drafted_tokens + extra, bonus


# -- lossy speculative sampling: beta solved vs beta = 1 -------------------------------------------

def _procedure_law(q, p, alpha, beta):
    """Section 2 of the paper, computed directly: accept x w.p. min(1, p(x) / ((1-alpha) q(x))), else resample
    from norm(max{0, p/beta - q})."""
    acc = torch.where(q > 0, torch.clamp(p / ((1 - alpha) * torch.where(q > 0, q, 1.0)), max=1.0), 0.0) * q
    res = torch.clamp(p / beta - q, min=0.0)
    res = res / torch.where(res.sum(-1, keepdim=True) > 0, res.sum(-1, keepdim=True), 1.0)
    return acc + (1 - acc.sum(-1, keepdim=True)) * res


def test_fixed_beta_target_is_the_procedures_law():
    g = np.random.default_rng(5)
    q = torch.tensor(np.stack([random_dist(g, 5, True) for _ in range(300)]))
    p = torch.tensor(np.stack([random_dist(g, 5, True) for _ in range(300)]))
    for alpha in (0.0, 0.2, 0.6, 0.95):
        for beta in sorted({1.0, 1.0 - alpha, 1.0 - alpha / 2}):
            pi = lossy_target_fixed_beta(q, p, alpha, beta)
            assert torch.allclose(pi.sum(-1), torch.ones(300, dtype=torch.float64), atol=1e-12)
            assert torch.allclose(pi, _procedure_law(q, p, alpha, beta), atol=1e-12)
            # GenSpecSample on pi accepts as the procedure does: min(1, pi/q) == min(1, p / ((1-alpha) q))
            ok = q > 0
            assert torch.allclose(torch.clamp(pi / torch.where(ok, q, 1), max=1)[ok],
                                  torch.clamp(p / ((1 - alpha) * torch.where(ok, q, 1)), max=1)[ok], atol=1e-12)
    assert torch.allclose(lossy_target_fixed_beta(q, p, 0.0, 1.0), p, atol=1e-12)     # alpha 0: lossless
    assert (lossy_target(q, p, 0.6, 1.0) - lossy_target(q, p, 0.6)).abs().max() > 1e-2  # differs from solved


@pytest.mark.parametrize("alpha,beta,bonus", [(0.3, 1.0, "p"), (0.6, 1.0, "pi"), (0.6, 0.5, "pi")])
def test_lossy_fixed_beta_emits_its_law(alpha, beta, bonus):
    target, drafter = _models(3, 7)
    fn = lambda q, p, qr, pr: lossy_target_fixed_beta(q, p, alpha, beta)
    got = _engine_dist(target, drafter, "lossy", {"alpha": alpha, "k": 1, "beta": beta, "bonus": bonus}, 3)
    assert max_abs_diff(got, block_law(target, drafter, [0], 3, 1, T1, fn, bonus)) < 1e-9
    solved = _engine_dist(target, drafter, "lossy", {"alpha": alpha, "k": 1, "bonus": bonus}, 3)
    assert max_abs_diff(got, solved) > 1e-6          # both exact to 1e-9: the variants differ


@pytest.mark.parametrize("strategy,options,pattern", [
    ("lossy", {"alpha": 0.3, "beta": 0.5}, r"invalid beta: 0\.5 \(allowed: 'solve' or a number in \[1 - alpha, 1\] "
                                           r"= \[0\.7, 1\]\)"),
    ("lossy", {"beta": "one"}, r"invalid beta: 'one' \(allowed: 'solve' or a number in \[1 - alpha, 1\]\)"),
    ("lossy", {"beta": 1.5}, r"invalid beta: 1\.5"),
    ("spec_cascade", {"bonus": "q"}, r"invalid bonus: 'q' \(allowed: one of p, pi\)"),
    ("spec_cascade", {"beta": 1.0}, r"invalid option: 'beta' \(allowed: options of strategy spec_cascade"),
])
def test_variant_option_errors(strategy, options, pattern):
    target, drafter = _models(3, 0)
    engine = local_engine({"target": target, "drafter": drafter}, VocabTokenizer(3))
    with pytest.raises(ParamError, match=pattern):
        engine.generate(GenerationRequest(prompt_ids=[0], max_new_tokens=2, strategy=strategy, options=options))
