"""Exact enumeration: token-level speculative sampling emits exactly the target distribution."""
import numpy as np
import pytest
import torch

from cluster.core.sampling import SamplingParams, logits_to_probs
from cluster.core.verify import verify_tokens
from tests.support.exact import (
    engine_vs_target,
    enumerate_outcomes,
    max_abs_diff,
    random_dist,
)


@pytest.mark.parametrize("vocab,L,seed,zeros", [(6, 1, 0, False), (6, 3, 1, True), (5, 3, 2, True),
                                                 (4, 2, 3, True), (3, 3, 4, False)])
def test_one_step_first_token_is_target_distributed(vocab, L, seed, zeros):
    """Draft x_1..x_L ~ q, verify against p: the first emitted token is distributed as p_1, and the
    accepted prefix followed by the recovered/bonus token has its exact joint probability."""
    rng_np = np.random.default_rng(seed)
    # position-independent tables keep this a pure test of verify_tokens on literal arrays
    q = torch.tensor(np.stack([random_dist(rng_np, vocab, zeros) for _ in range(L)]))
    p = torch.tensor(np.stack([random_dist(rng_np, vocab, False) for _ in range(L + 1)]))

    def run(rng):
        draft = [rng.categorical(q[i]) for i in range(L)]
        v = verify_tokens(draft, q, p, rng)
        return v.next_token if v.accepted == 0 else draft[0]

    dist = enumerate_outcomes(run)
    expect = {t: float(p[0, t]) for t in range(vocab) if p[0, t] > 0}
    assert max_abs_diff(dist, expect) < 1e-12


@pytest.mark.parametrize("vocab,k,seed", [(4, 1, 0), (4, 3, 1), (5, 2, 2), (3, 3, 3)])
def test_engine_speculative_equals_target_joint(vocab, k, seed):
    """The whole engine (drafter proposals, verification, commits) over 3 tokens: exact target joint."""
    got, want = engine_vs_target(vocab, k, 3, seed, SamplingParams(1.0))
    assert max_abs_diff(got, want) < 1e-9


@pytest.mark.parametrize("sampling", [SamplingParams(0.7), SamplingParams(1.3, top_k=3),
                                      SamplingParams(1.0, top_p=0.8)])
def test_engine_speculative_matches_processed_target(sampling):
    """With temperature / top-k / top-p, the output follows the *processed* target distribution."""
    got, want = engine_vs_target(4, 2, 3, 7, sampling)
    assert max_abs_diff(got, want) < 1e-9


def test_greedy_is_deterministic_and_equals_target_argmax():
    got, want = engine_vs_target(5, 3, 4, 11, SamplingParams(0.0))
    assert len(got) == 1 and got == want


def test_literal_accept_reject():
    """Literal arrays: q puts all mass on token 1 where p gives it 1/4 -> accept w.p. 1/4, else
    recover from norm(max(0, p - q)) which excludes token 1."""
    q = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    p = torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]], dtype=torch.float64)
    dist = enumerate_outcomes(lambda rng: (lambda v: (v.accepted, v.next_token, v.bonus))(
        verify_tokens([1], q, p, rng)))
    assert dist == pytest.approx({(1, 0, True): 0.25 * 0.2, (1, 1, True): 0.25 * 0.3,
                                  (1, 2, True): 0.25 * 0.5, (0, 0, False): 0.75 * 2 / 3,
                                  (0, 2, False): 0.75 * 1 / 3}, abs=1e-15)


def test_logits_to_probs_filters():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    assert logits_to_probs(logits, SamplingParams(0.0)).tolist() == [1, 0, 0, 0]
    topk = logits_to_probs(logits, SamplingParams(1.0, top_k=2))
    assert (topk[2:] == 0).all() and abs(float(topk.sum()) - 1) < 1e-12
    full = torch.softmax(logits.double(), -1)
    topp = logits_to_probs(logits, SamplingParams(1.0, top_p=0.7))   # 0.61 < 0.7 -> keep two tokens
    assert float(full[0]) < 0.7 < float(full[:2].sum())
    assert (topp[2:] == 0).all() and torch.allclose(topp[:2], full[:2] / full[:2].sum())
