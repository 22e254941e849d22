"""Speculative cascades and lossy speculative sampling emit exactly their own target distribution pi."""
import numpy as np
import pytest
import torch

from cluster.core.cascade_targets import RULES, cascade_target, lossy_target, tv
from cluster.core.sampling import UNSCALED, Rng, SamplingParams, logits_to_probs
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError
from tests.support.exact import (
    TabularModel,
    VocabTokenizer,
    enumerate_outcomes,
    local_engine,
    max_abs_diff,
    pi_joint,
    random_dist,
    target_joint,
)

NEVER, ALWAYS = 1.0, -2.0      # the alpha ends of every cascade rule


def _pairs(n, vocab, seed, zeros=True):
    g = np.random.default_rng(seed)
    q = torch.tensor(np.stack([random_dist(g, vocab, zeros) for _ in range(n)]))      # [n, V]
    p = torch.tensor(np.stack([random_dist(g, vocab, zeros) for _ in range(n)]))      # [n, V]
    return q, p


# -- the target functions on literal tensors -------------------------------------------------------

@pytest.mark.parametrize("rule", sorted(RULES))
def test_cascade_pi_is_a_distribution_and_has_both_ends(rule):
    q, p = _pairs(200, 5, 1)
    for alpha in (ALWAYS, -0.5, 0.0, 0.05, 0.2, 0.5, 0.9, NEVER):
        pi = cascade_target(q, p, rule, alpha)
        assert (pi >= 0).all() and torch.allclose(pi.sum(-1), torch.ones(200, dtype=torch.float64), atol=1e-12)
    assert torch.equal(cascade_target(q, p, rule, NEVER), q)
    always = cascade_target(q, p, rule, ALWAYS)
    assert torch.allclose(always, p, atol=1e-15) or rule == "opt"
    if rule == "opt":   # OPT keeps q only where TV(p, q) = 0, i.e. where q = p anyway
        assert torch.allclose(always, p, atol=1e-12)


def test_cascade_rules_literal():
    q = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    p = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)
    # chow defers iff 0.6 < 1 - alpha; diff iff 0.6 < 0.7 - alpha; opt iff 0.6 < 0.7 - alpha * TV (TV = 0.6)
    assert torch.equal(cascade_target(q, p, "chow", 0.3), p) and torch.equal(cascade_target(q, p, "chow", 0.4), q)
    assert torch.equal(cascade_target(q, p, "diff", 0.05), p) and torch.equal(cascade_target(q, p, "diff", 0.1), q)
    assert abs(float(tv(p, q)) - 0.6) < 1e-12
    assert torch.equal(cascade_target(q, p, "opt", 0.15), p) and torch.equal(cascade_target(q, p, "opt", 0.2), q)
    # token_v1 at alpha 0.2: defer tokens with q(v) < 0.5 -> tokens 1, 2; eta = 0.4
    assert torch.allclose(cascade_target(q, p, "token_v1", 0.2), torch.tensor([0.6 + 0.04, 0.08, 0.28], dtype=torch.float64))
    # token_v2 at alpha 0.55: defer p(v) < 0.15 -> token 0; eta = 0.6
    assert torch.allclose(cascade_target(q, p, "token_v2", 0.55), torch.tensor([0.06, 0.3 + 0.12, 0.1 + 0.42], dtype=torch.float64))
    # token_v3 at alpha 0.5: defer p(v) < 0.35 -> tokens 0, 1; eta = 0.9
    assert torch.allclose(cascade_target(q, p, "token_v3", 0.5), torch.tensor([0.09, 0.18, 0.1 + 0.63], dtype=torch.float64))


def test_rules_read_unscaled_mixture_uses_scaled():
    """The later version of Narasimhan et al., *Faster Cascades via Speculative Decoding*, appendix C.1: the
    decision comes from the raw distributions, the mix from the scaled ones."""
    q_raw = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)     # e.g. greedy
    p = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    # chow at alpha 0.2: raw max 0.5 < 0.8 -> defer (the scaled max 1.0 would not)
    assert torch.equal(cascade_target(q, p, "chow", 0.2, q_raw=q_raw, p_raw=p), p)
    assert torch.equal(cascade_target(q, p, "chow", 0.2), q)


def test_lossy_pi_solves_beta():
    q, p = _pairs(300, 5, 2)
    for alpha in (0.0, 0.1, 0.4, 0.8, 0.99):
        pi = lossy_target(q, p, alpha)
        assert (pi >= 0).all() and torch.allclose(pi.sum(-1), torch.ones(300, dtype=torch.float64), atol=1e-12)
        m = torch.minimum(q, p / (1 - alpha))
        assert (pi >= m - 1e-12).all() and (pi <= torch.maximum(q, p / (1 - alpha)) + 1e-12).all()
        # where pi rises above min{q, p/(1-alpha)} it equals p / beta with one beta >= 1 - alpha per row
        up = pi > m + 1e-12
        t = torch.where(up, pi / torch.where(up, p, 1.0), torch.nan)
        rows = up.any(-1)
        tmax, tmin = torch.nan_to_num(t, nan=-1).amax(-1), torch.nan_to_num(t, nan=1e9).amin(-1)
        assert torch.allclose(tmax[rows], tmin[rows], atol=1e-9)
        assert (tmax[rows] <= 1 / (1 - alpha) + 1e-9).all()          # beta = 1 / t >= 1 - alpha
        # where pi stays at m, p / beta does not exceed it
        stay = ~up & rows.unsqueeze(-1)
        assert ((tmax.unsqueeze(-1) * p)[stay] <= m[stay] + 1e-9).all()
    assert torch.equal(lossy_target(q, p, 0.0), p)                    # alpha = 0: lossless


def test_lossy_near_one_reproduces_full_support_drafter():
    q, p = _pairs(50, 4, 3, zeros=False)
    assert torch.allclose(lossy_target(q, p, 1 - 1e-9), q, atol=1e-12)


def test_parameter_errors_in_functions():
    q, p = _pairs(2, 3, 4)
    with pytest.raises(ParamError, match=r"alpha.*1\.0.*\[0\.0, 1\.0\)"):
        lossy_target(q, p, 1.0)
    with pytest.raises(ParamError, match=r"rule.*'bogus'.*chow, diff, opt"):
        cascade_target(q, p, "bogus", 0.1)
    with pytest.raises(ParamError, match=r"alpha.*3\.0.*\[-2\.0, 1\.0\]"):
        cascade_target(q, p, "chow", 3.0)


# -- the strategies, enumerated exactly through the engine -----------------------------------------

def _models(vocab, seed):
    return TabularModel("target", vocab, seed=seed), TabularModel("drafter", vocab, seed=seed + 1000, zeros=True)


def _engine_dist(target, drafter, strategy, options, n, sampling, sampler="batched"):
    holder = {}
    engine = local_engine({"target": target, "drafter": drafter}, VocabTokenizer(target.vocab_size),
                          rng_factory=lambda s: holder["rng"], sampler=sampler)

    def run(rng):
        holder["rng"] = drafter.rng = rng
        res = engine.generate(GenerationRequest(prompt_ids=[0], max_new_tokens=n, sampling=sampling, seed=0,
                                                strategy=strategy, options={"drafter": "drafter", **options}))
        return tuple(res.token_ids)

    return enumerate_outcomes(run)


T1 = SamplingParams(1.0)


@pytest.mark.parametrize("rule,alpha,vocab,seed", [("chow", 0.5, 4, 0), ("diff", 0.05, 4, 1), ("opt", 0.2, 3, 2),
                                                   ("token_v1", 0.1, 4, 3), ("token_v2", 0.2, 3, 4),
                                                   ("token_v3", 0.4, 4, 5)])
def test_spec_cascade_emits_its_pi(rule, alpha, vocab, seed):
    """k covers the budget, so each emitted token sits at a draft position: the joint of 2 tokens is
    exactly the chain of the rule's pi (and not the target's, for these alphas)."""
    target, drafter = _models(vocab, seed)
    fn = lambda q, p, qr, pr: cascade_target(q, p, rule, alpha, qr, pr)
    got = _engine_dist(target, drafter, "spec_cascade", {"rule": rule, "alpha": alpha, "k": 2}, 2, T1)
    want = pi_joint(target, drafter, [0], 2, T1, fn)
    assert max_abs_diff(got, want) < 1e-9
    first = {}
    for seq, w in got.items():
        first[seq[0]] = first.get(seq[0], 0.0) + w
    pi1 = fn(*(logits_to_probs(m.logits([0]), s) for s in (T1, UNSCALED) for m in (drafter, target)))
    assert max_abs_diff(first, {t: v for t, v in enumerate(pi1.tolist()) if v > 0}) < 1e-12


@pytest.mark.parametrize("rule,alpha,sampling,seed", [("chow", 0.05, SamplingParams(0.5), 6),
                                                      ("opt", 0.05, SamplingParams(1.5), 7),
                                                      ("token_v1", 0.05, SamplingParams(0.5), 8)])
def test_spec_cascade_with_temperature_follows_appendix_c(rule, alpha, sampling, seed):
    """Rules on the unscaled distributions, mixture on the scaled ones -- and this is observable:
    reading the scaled ones in the rule would give a different law."""
    target, drafter = _models(4, seed)
    fn = lambda q, p, qr, pr: cascade_target(q, p, rule, alpha, qr, pr)
    got = _engine_dist(target, drafter, "spec_cascade", {"rule": rule, "alpha": alpha, "k": 2}, 2, sampling)
    assert max_abs_diff(got, pi_joint(target, drafter, [0], 2, sampling, fn)) < 1e-9
    scaled_rule = pi_joint(target, drafter, [0], 2, sampling, lambda q, p, qr, pr: cascade_target(q, p, rule, alpha))
    assert max_abs_diff(got, scaled_rule) > 0.1


@pytest.mark.parametrize("alpha", [0.3, 0.7])
def test_lossy_emits_its_pi(alpha):
    target, drafter = _models(4, 7)
    got = _engine_dist(target, drafter, "lossy", {"alpha": alpha, "k": 2}, 2, T1)
    want = pi_joint(target, drafter, [0], 2, T1, lambda q, p, qr, pr: lossy_target(q, p, alpha))
    assert max_abs_diff(got, want) < 1e-9
    assert max_abs_diff(got, target_joint(target, [0], 2)) > 1e-3


@pytest.mark.parametrize("strategy,options", [("spec_cascade", {"rule": "diff", "k": 2}),
                                              ("spec_cascade", {"rule": "token_v3", "k": 4}),
                                              ("token_cascade", {}),
                                              ("oracle_cascade", {"rule": "opt"})])
def test_alpha_ends_reproduce_drafter_and_target(strategy, options):
    """k >= the 2-token budget, so no bonus token (Algorithm 4 draws it from p) falls inside it."""
    target, drafter = _models(3, 8)
    never = _engine_dist(target, drafter, strategy, {**options, "alpha": NEVER}, 2, T1)
    always = _engine_dist(target, drafter, strategy, {**options, "alpha": ALWAYS}, 2, T1)
    assert max_abs_diff(never, target_joint(drafter, [0], 2)) < 1e-9
    assert max_abs_diff(always, target_joint(target, [0], 2)) < 1e-9


def test_lossy_alpha_zero_is_lossless():
    target, drafter = _models(3, 9)
    got = _engine_dist(target, drafter, "lossy", {"alpha": 0.0, "k": 2}, 3, T1)
    assert max_abs_diff(got, target_joint(target, [0], 3)) < 1e-9


@pytest.mark.parametrize("alpha", [0.45, 0.7])
def test_token_cascade_is_sequential_chow(alpha):
    target, drafter = _models(4, 10)
    got = _engine_dist(target, drafter, "token_cascade", {"alpha": alpha}, 3, T1)
    want = pi_joint(target, drafter, [0], 3, T1, lambda q, p, qr, pr: cascade_target(q, p, "chow", alpha, qr, pr))
    assert max_abs_diff(got, want) < 1e-9


def test_oracle_cascade_is_its_rule():
    target, drafter = _models(4, 11)
    got = _engine_dist(target, drafter, "oracle_cascade", {"rule": "diff", "alpha": 0.1}, 2, T1)
    want = pi_joint(target, drafter, [0], 2, T1, lambda q, p, qr, pr: cascade_target(q, p, "diff", 0.1, qr, pr))
    assert max_abs_diff(got, want) < 1e-9


def test_token_cascade_counts_target_calls_honestly():
    """The target runs once per deferral and never otherwise."""
    target, drafter = _models(4, 12)
    engine = local_engine({"target": target, "drafter": drafter}, VocabTokenizer(4))
    for alpha, expect in ((NEVER, 0), (ALWAYS, 12)):
        drafter.rng = Rng(alpha == NEVER)
        before = target.forwards
        res = engine.generate(GenerationRequest(prompt_ids=[0], max_new_tokens=12, seed=1, strategy="token_cascade",
                                                options={"drafter": "drafter", "alpha": alpha}))
        assert len(res.token_ids) == 12
        assert res.stats.target_forwards == target.forwards - before == expect


# -- option validation through the engine ----------------------------------------------------------

@pytest.mark.parametrize("strategy,options,pattern", [
    ("spec_cascade", {"alpha": 1.5}, r"invalid alpha: 1\.5 \(allowed: number in \[-2\.0, 1\.0\]\)"),
    ("spec_cascade", {"rule": "nope"}, r"invalid rule: 'nope' \(allowed: one of chow, diff, opt, token_v1"),
    ("lossy", {"alpha": 1.0}, r"invalid alpha: 1\.0 \(allowed: number in \[0, 1\) for strategy lossy\)"),
    ("lossy", {"alpha": -0.1}, r"invalid alpha: -0\.1"),
    ("token_cascade", {"alpha": "x"}, r"invalid alpha: 'x'"),
])
def test_option_errors_name_parameter_range_and_value(strategy, options, pattern):
    target, drafter = _models(3, 0)
    engine = local_engine({"target": target, "drafter": drafter}, VocabTokenizer(3))
    with pytest.raises(ParamError, match=pattern):
        engine.generate(GenerationRequest(prompt_ids=[0], max_new_tokens=2, strategy=strategy, options=options))


def test_strategies_are_marked_lossy():
    from cluster.strategies import REGISTRY
    for name in ("spec_cascade", "lossy", "token_cascade", "oracle_cascade"):
        assert REGISTRY[name].lossless is False


def test_spec_cascade_runs_on_tiny_models(tiny_engine):
    """The HF path: every rule and lossy generate at temperature 1 and 0 with consistent stats."""
    for strategy, opts in [("spec_cascade", {"rule": r, "alpha": 0.2}) for r in sorted(RULES)] + \
            [("lossy", {"alpha": 0.3}), ("token_cascade", {"alpha": 0.5}), ("oracle_cascade", {"rule": "diff"})]:
        for temp in (1.0, 0.0):
            res = tiny_engine.generate(GenerationRequest(prompt="def f(", max_new_tokens=12, ignore_eos=True, seed=3,
                                                         sampling=SamplingParams(temp), strategy=strategy,
                                                         options=opts))
            assert len(res.token_ids) == 12, (strategy, opts)
            assert res.stats.target_forwards <= 12
