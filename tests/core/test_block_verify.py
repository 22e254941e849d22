"""Block verification (Sun et al., *Optimal Block-Level Draft Verification for Accelerating Speculative Decoding*):
exact losslessness, exact expected accepted length, greedy equality."""
import pytest
import torch

from cluster.core.block_verify import block_weights, verify_block
from cluster.core.sampling import SamplingParams
from cluster.core.verifiers import VERIFIERS
from cluster.core.verify import verify_tokens
from cluster.engine.request import GenerationRequest
from tests.support.exact import (
    TabularModel,
    engine_vs_target,
    enumerate_outcomes,
    max_abs_diff,
    target_joint,
)


class _Cached(TabularModel):
    """A TabularModel whose tables are memoised (enumeration revisits the same prefixes many times)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._memo = {}

    def dist(self, prefix):
        key = tuple(prefix)
        if key not in self._memo:
            self._memo[key] = super().dist(prefix)
        return self._memo[key]


def _pair(vocab, L, seed, zeros=True):
    """Position-dependent random drafter/target tables over the draft tree (drafter with zeros)."""
    return (_Cached("drafter", vocab, seed=seed + 1000, zeros=zeros),
            _Cached("target", vocab, seed=seed, zeros=False))


def _rows(model, prefix, draft):
    """[len(draft)+1, V] distributions of ``model`` along prefix + draft."""
    return torch.stack([torch.tensor(model.dist(prefix + draft[:i])) for i in range(len(draft) + 1)])


def _one_step(verify, drafter, target, L, rng):
    """Draft L tokens from the drafter table, verify against the target table."""
    draft = []
    for _ in range(L):
        draft.append(rng.categorical(torch.tensor(drafter.dist(draft))))
    q = _rows(drafter, [], draft)[:L]
    p = _rows(target, [], draft)
    return draft, q, p, verify(draft, q, p, rng)


PAIRS = [(3, 1, 0), (3, 2, 1), (4, 2, 2), (3, 3, 3), (4, 3, 4), (2, 3, 5), (4, 3, 6), (3, 3, 7)]


@pytest.mark.parametrize("vocab,L,seed", PAIRS)
def test_one_block_then_target_is_target_joint(vocab, L, seed):
    """Accepted prefix + correction/bonus token, then continue sampling from the target to a fixed
    length L + 1: the joint law equals sampling L + 1 tokens from the target (~1e-12)."""
    drafter, target = _pair(vocab, L, seed)

    def run(rng):
        draft, q, p, v = _one_step(verify_block, drafter, target, L, rng)
        out = draft[:v.accepted] + [v.next_token]
        while len(out) < L + 1:
            out.append(rng.categorical(torch.tensor(target.dist(out))))
        return tuple(out)

    assert max_abs_diff(enumerate_outcomes(run), target_joint(target, [], L + 1)) < 1e-12


@pytest.mark.parametrize("vocab,L,seed", PAIRS)
def test_expected_accepted_is_sum_of_weights_and_beats_token(vocab, L, seed):
    """E[tau] = sum_{i=1..L} E[p_i] exactly, and >= token verification's E[accepted] on the same pair."""
    drafter, target = _pair(vocab, L, seed)

    def accepted(verify):
        return lambda rng: _one_step(verify, drafter, target, L, rng)[3].accepted

    def weight_sum(rng):
        draft, q, p, _ = _one_step(lambda *a: None, drafter, target, L, rng)
        return float(block_weights(draft, q, p)[0][1:].sum())

    mean = lambda d: sum(k * v for k, v in d.items())
    block, token = mean(enumerate_outcomes(accepted(verify_block))), mean(enumerate_outcomes(accepted(verify_tokens)))
    assert abs(block - mean(enumerate_outcomes(weight_sum))) < 1e-12
    assert block >= token - 1e-12


def test_block_strictly_beats_token_somewhere():
    """The gain is real: on some random pair block verification accepts strictly more in expectation."""
    gains = []
    for seed in range(4):
        drafter, target = _pair(3, 3, 100 + seed, zeros=False)
        acc = lambda verify: sum(k * v for k, v in enumerate_outcomes(
            lambda rng: _one_step(verify, drafter, target, 3, rng)[3].accepted).items())
        gains.append(acc(verify_block) - acc(verify_tokens))
    assert min(gains) >= -1e-12 and max(gains) > 1e-3


def test_literal_rescue():
    """Two draft tokens: x_1 is under-weighted by the target (ratio 1/2), x_2 over-weighted (ratio 2).
    Token verification keeps x_1 x_2 w.p. 1/2; block verification w.p. p_2 = min(1/2 * 2, 1) = 1."""
    q = torch.tensor([[0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.3, 0.7]], dtype=torch.float64)
    w, h = block_weights([1, 0], q, p)
    assert w.tolist() == [1.0, 0.5, 1.0]
    # R_1 = sum max(0.5 * [1, 0] - [0.5, 0.5], 0) = 0 -> h_1 = 0 / (0 + 0.5) = 0; h_2 = p_2 = 1
    assert h.tolist() == [0.0, 1.0]
    out = lambda verify: enumerate_outcomes(lambda rng: (lambda v: (v.accepted, v.next_token))(verify([1, 0], q, p, rng)))
    assert out(verify_block) == pytest.approx({(2, 0): 0.3, (2, 1): 0.7}, abs=1e-15)
    token = out(verify_tokens)
    assert token[(2, 0)] + token[(2, 1)] == pytest.approx(0.5, abs=1e-15)


def test_underflow_in_log_space():
    """Long drafts whose per-token ratios are tiny then huge: the clipped product survives in log space."""
    L = 40
    q = torch.tensor([[1e-12, 1 - 1e-12, 0.0]] * L, dtype=torch.float64)
    p = torch.tensor([[0.5, 0.5, 0.0]] * (L + 1), dtype=torch.float64)
    draft = [0] * L       # each ratio 0.5 / 1e-12 -> clipped at 1 immediately
    w, h = block_weights(draft, q, p)
    assert torch.all(w == 1.0) and float(h[-1]) == 1.0
    q2 = torch.tensor([[1 - 1e-30, 1e-30, 0.0]] * L, dtype=torch.float64)
    p2 = torch.tensor([[1e-30, 1 - 1e-30, 0.0]] * (L + 1), dtype=torch.float64)
    w2, h2 = block_weights([0] * 20 + [1] * 20, q2, p2)
    # the running product reaches 1e-600 (0.0 in float64) and comes back to 1: only log space keeps it
    assert torch.isfinite(w2).all() and torch.isfinite(h2).all() and abs(float(w2[-1]) - 1.0) < 1e-9


@pytest.mark.parametrize("vocab,k,seed,sampling", [(4, 3, 1, SamplingParams(1.0)), (3, 2, 2, SamplingParams(1.0)),
                                                   (4, 2, 7, SamplingParams(0.7, top_p=0.9))])
def test_engine_block_speculative_equals_target_joint(vocab, k, seed, sampling):
    """The whole engine with --verify block over 3 tokens: exactly the (processed) target joint."""
    got, want = engine_vs_target(vocab, k, 3, seed, sampling, verify="block")
    assert max_abs_diff(got, want) < 1e-9


def test_engine_block_greedy_is_target_argmax():
    got, want = engine_vs_target(5, 3, 4, 11, SamplingParams(0.0), verify="block")
    assert len(got) == 1 and got == want


def test_block_registered():
    assert VERIFIERS["block"] is verify_block


def test_greedy_block_equals_greedy_target_on_tiny_models(tiny_engine):
    """Temperature 0 on the tiny HF models: block-verified speculative decoding == plain target decoding."""
    greedy = SamplingParams(0.0)
    for prompt in ["def f(", "import numpy as np\n"]:
        base = tiny_engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=24, sampling=greedy,
                                                      strategy="autoregressive", ignore_eos=True))
        for k in (2, 5):
            spec = tiny_engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=24, sampling=greedy,
                                                          strategy="speculative", ignore_eos=True,
                                                          options={"k": k, "verify": "block"}))
            assert spec.token_ids == base.token_ids
            assert spec.stats.steps > 0


def test_bench_expected_accepted_matches_enumeration():
    """The verify bench's paired estimate: averaged over drafts from the drafter, the per-draft values
    equal each verifier's exact expected accepted length (token: exactly per draft; block: sum_i p_i,
    whose mean over drafts is E[tau])."""
    from cluster.bench.verify import expected_accepted
    drafter, target = _pair(3, 3, 21)

    def per_draft(rng):
        draft, q, p, _ = _one_step(lambda *a: None, drafter, target, 3, rng)
        return expected_accepted(draft, q, p)

    draws = enumerate_outcomes(per_draft)
    tok = sum(k[0] * v for k, v in draws.items())
    blk = sum(k[1] * v for k, v in draws.items())
    mean = lambda verify: sum(k * v for k, v in enumerate_outcomes(
        lambda rng: _one_step(verify, drafter, target, 3, rng)[3].accepted).items())
    assert abs(tok - mean(verify_tokens)) < 1e-12 and abs(blk - mean(verify_block)) < 1e-12
    assert blk > tok
