"""EWIF formulas (Chen et al., *Cascade Speculative Drafting for Even Faster LLM Inference*, section 4) against Monte
Carlo simulation of i.i.d. acceptance; SWI."""
import random
from typing import Sequence

import pytest

from cluster.core.cost_model import (
    CascadeModel,
    ewif_cascade,
    ewif_speculative,
    expected_tokens,
    phi,
    swi,
)
from cluster.core.stats import RequestStats


# The paper's closed forms for the two-level cases (Chen et al., section 4): independent oracles for the general
# K-matrix form ``ewif_cascade`` that the code uses.
def ewif_vertical(alpha: float, alpha_d: float, k: int, n: int, c1: float, c2: float) -> float:
    """Theorem 4.3: the target reviews n steps of d1, each reviewing k tokens of d2:
    (1 - alpha phi^n(alpha)) / ((1 - alpha)(1 + n c1 + n k c2)), phi = phi_(alpha(d1, d2), k);
    alpha = alpha(target, d1), alpha_d = alpha(d1, d2)."""
    f = phi(alpha_d, k, alpha) ** n
    tokens = float(n * (k + 1) + 1) if alpha >= 1.0 else (1.0 - alpha * f) / (1.0 - alpha)
    return tokens / (1.0 + n * c1 + n * k * c2)


def ewif_horizontal(alphas: Sequence[float], costs: Sequence[float]) -> float:
    """Theorem 4.5: draft token i made by model i (acceptance alpha_i, cost c_i):
    sum_{i=0}^k prod_{j<=i} alpha_j / (1 + sum_i c_i)."""
    num, prod = 1.0, 1.0
    for a in alphas:
        prod *= a
        num += prod
    return num / (1.0 + sum(costs))


N = 40000


def _accept_prefix(rng, alphas):
    """Number of leading draft tokens accepted, each independently with its probability."""
    for i, a in enumerate(alphas):
        if rng.random() >= a:
            return i
    return len(alphas)


def _mc_speculative(alpha, k, seed=0):
    rng = random.Random(seed)
    return sum(_accept_prefix(rng, [alpha] * k) + 1 for _ in range(N)) / N


@pytest.mark.parametrize("alpha,k,c", [(0.6, 4, 0.1), (0.85, 7, 0.05), (0.3, 2, 0.5)])
def test_speculative_ewif_matches_monte_carlo(alpha, k, c):
    mc = _mc_speculative(alpha, k)
    assert abs(expected_tokens(alpha, k) - mc) < 0.03
    assert ewif_speculative(alpha, k, c) == pytest.approx(mc / (1 + c * k), abs=0.03)
    # phi is a PGF: phi(1) = 1 and phi'(1) = expected tokens
    h = 1e-6
    assert phi(alpha, k, 1.0) == pytest.approx(1.0)
    assert (phi(alpha, k, 1 + h) - phi(alpha, k, 1 - h)) / (2 * h) == pytest.approx(expected_tokens(alpha, k), rel=1e-6)


@pytest.mark.parametrize("alpha,alpha_d,k,n,c1,c2", [(0.7, 0.5, 3, 2, 0.2, 0.01), (0.8, 0.9, 5, 3, 0.1, 0.0)])
def test_vertical_theorem_4_3_matches_monte_carlo(alpha, alpha_d, k, n, c1, c2):
    """d1 reviews k tokens of d2 n times; the target reviews the resulting draft."""
    rng = random.Random(1)
    total = 0
    for _ in range(N):
        J = sum(_accept_prefix(rng, [alpha_d] * k) + 1 for _ in range(n))
        total += _accept_prefix(rng, [alpha] * J) + 1
    mc = total / N / (1 + n * c1 + n * k * c2)
    assert ewif_vertical(alpha, alpha_d, k, n, c1, c2) == pytest.approx(mc, rel=0.02)
    # the general K-matrix model reproduces Theorem 4.3 with K = [[n, 0], [0, k]]
    K, A = [[n, 0], [0, k]], [[alpha, alpha], [0.0, alpha_d]]
    assert ewif_cascade(K, A, [c1, c2], bottom_per_token=True) == \
        pytest.approx(ewif_vertical(alpha, alpha_d, k, n, c1, c2), rel=1e-12)


def test_horizontal_theorem_4_5_matches_monte_carlo():
    alphas, costs = [0.9, 0.7, 0.5, 0.4], [0.2, 0.05, 0.01, 0.01]
    rng = random.Random(2)
    mc = sum(_accept_prefix(rng, alphas) + 1 for _ in range(N)) / N / (1 + sum(costs))
    assert ewif_horizontal(alphas, costs) == pytest.approx(mc, rel=0.02)


def _mc_cascade(K, A, cost, per_token, seed=3, runs=20000):
    """Simulate the CS Drafting recursion with i.i.d. acceptance per (reviewer, source)."""
    rng = random.Random(seed)
    n = len(K)

    def draft(r):
        srcs = []
        for j in range(r, n):
            if j == n - 1:
                srcs += [j] * K[r][j]
            else:
                for _ in range(K[r][j]):
                    sub = draft(j + 1)
                    srcs += [j] * (_accept_prefix(rng, [A[j + 1][s] for s in sub]) + 1)
        return srcs

    total = sum(_accept_prefix(rng, [A[0][s] for s in d]) + 1 for d in (draft(0) for _ in range(runs)))
    return total / runs / (1 + CascadeModel(K, A, cost, per_token).cost_of(0))


@pytest.mark.parametrize("K", [[[2, 0, 3], [0, 1, 2], [0, 0, 4]], [[1, 2, 1], [0, 2, 5], [0, 0, 3]], [[2, 5], [0, 5]]])
def test_general_cascade_matches_monte_carlo(K):
    A = [[0.8, 0.7, 0.4], [0.0, 0.75, 0.5], [0.0, 0.0, 0.6]]
    A = [row[-len(K):] for row in A[-len(K):]] if len(K) == 2 else A
    cost = [0.3, 0.05, 0.001][-len(K):]
    assert ewif_cascade(K, A, cost) == pytest.approx(_mc_cascade(K, A, cost, False), rel=0.02)


def test_swi_counts_forward_passes_by_cost():
    s = RequestStats(generated_tokens=30, target_forwards=10, drafter_forwards={"small": 40, "mag": 10})
    costs = {"target": 100.0, "small": 10.0, "mag": 0.0}
    assert swi(s, costs) == pytest.approx(30 * 100 / (10 * 100 + 40 * 10))
    ar = RequestStats(generated_tokens=30, target_forwards=30)
    assert swi(ar, costs) == pytest.approx(1.0)
