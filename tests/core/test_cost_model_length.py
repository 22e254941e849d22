"""The cost model charged by length (``specserve tune``): a forward's cost grows with the tokens it feeds,
measured as a ForwardCost table, checked against Monte Carlo simulation."""
import random

import pytest

from cluster.core.cost_model import (
    CascadeModel,
    ewif_cascade,
    expected_tokens,
    predict_cascade,
    ranked_cascades,
)
from cluster.core.forward_cost import ForwardCost, best_k


def _accept_prefix(rng, alphas):
    for i, a in enumerate(alphas):
        if rng.random() >= a:
            return i
    return len(alphas)


def _mc(K, A, cost, target_cost, per_token, runs=30000, seed=4):
    """Tokens per unit of cost, simulating the recursion and charging each forward by its real length."""
    rng = random.Random(seed)
    n = len(K)
    spent = [0.0]

    def draft(r):
        srcs = []
        for j in range(r, n):
            b = K[r][j]
            if b <= 0:
                continue
            if j == n - 1:
                srcs += [j] * b
                spent[0] += cost[j](1) * b if per_token else cost[j](b)
            else:
                for _ in range(b):
                    sub = draft(j + 1)
                    spent[0] += cost[j](len(sub) + 1)
                    srcs += [j] * (_accept_prefix(rng, [A[j + 1][s] for s in sub]) + 1)
        return srcs

    tokens = 0
    for _ in range(runs):
        d = draft(0)
        spent[0] += target_cost(len(d) + 1)
        tokens += _accept_prefix(rng, [A[0][s] for s in d]) + 1
    return tokens / spent[0]


@pytest.mark.parametrize("K,per_token", [([[2, 0, 3], [0, 1, 2], [0, 0, 4]], False), ([[2, 4], [0, 6]], False),
                                         ([[1, 2], [0, 3]], True)])
def test_length_charged_cascade_matches_monte_carlo(K, per_token):
    A = [[0.8, 0.7, 0.4], [0.0, 0.75, 0.5], [0.0, 0.0, 0.6]]
    if len(K) == 2:
        A = [[0.8, 0.5], [0.0, 0.6]]
    cost = [lambda t: 0.2 + 0.05 * t, lambda t: 0.03 + 0.01 * t, lambda t: 0.001][-len(K):]
    target = lambda t: 1.0 + 0.15 * (t - 1)                       # a verification of L tokens: 1 + 0.15 L
    model = CascadeModel(K, A, cost, per_token, target_cost=target)
    assert model.ewif() == pytest.approx(_mc(K, A, cost, target, per_token), rel=0.02)
    flat = CascadeModel(K, A, [c(1) for c in cost], per_token)
    assert model.ewif() < flat.ewif()                              # longer drafts cost more now
    assert ewif_cascade(K, A, [c(1) for c in cost], per_token) == flat.ewif()   # per-call model unchanged


def _table(base, per_token):
    return ForwardCost({(1, t): base + per_token * t for t in (1, 2, 4, 8, 16, 32)})


def test_length_charging_changes_the_ranking():
    """Per call, a drafter review of a long MaG tail costs as much as a short one; by length it does not --
    so with a verification cost that grows steeply, the best K shortens."""
    alphas = {("target", "small"): 0.7, ("target", "mag"): 0.3, ("small", "mag"): 0.4}
    costs = {"target": 1e-2, "small": 1e-3, "mag": 1e-5}
    forward = {"target": _table(1e-2, 2e-3), "small": _table(1e-3, 3e-4)}
    per_call = ranked_cascades(["small", "mag"], "target", alphas, costs)[0][0]
    by_length = ranked_cascades(["small", "mag"], "target", alphas, costs, forward=forward)[0][0]
    model = CascadeModel(by_length, [[0.7, 0.3], [0.0, 0.4]], [None, None])
    tails = lambda K: K[0][1] + K[1][1] * K[0][0]                  # MaG tokens drafted per step
    assert tails(by_length) < tails(per_call)
    assert model.draft_len(0) > 0
    want = predict_cascade(by_length, ["small", "mag"], "target", alphas, costs, forward=forward)
    assert want == max(predict_cascade(K, ["small", "mag"], "target", alphas, costs, forward=forward)
                       for K in [((a, b), (0, c)) for a in (1, 2, 3, 4) for b in (0, 1, 2, 4, 6)
                                 for c in (1, 2, 3, 4, 6, 8, 10)])


def test_forward_cost_interpolates_and_extrapolates():
    c = ForwardCost({(1, 1): 1.0, (1, 5): 2.0, (4, 1): 2.0, (4, 5): 6.0})
    assert c(1, 1) == 1.0 and c(4, 5) == 6.0                       # grid points
    assert c(1, 3) == pytest.approx(1.5)                           # along tokens
    assert c(4, 3) == pytest.approx(4.0)
    assert c(2, 1) == pytest.approx(1.0 + 1.0 / 3)                 # along rows
    assert c(2, 3) == pytest.approx(1.5 + 2.5 / 3)                 # bilinear
    assert c(1, 9) == pytest.approx(3.0)                           # beyond: linear extrapolation
    assert c(8, 1) == pytest.approx(2.0 + 4 * 1.0 / 3)
    assert c(8, 9) == pytest.approx(3.0 + 7 / 3 * (10.0 - 3.0))    # both axes beyond the grid
    assert c(-100, 1) == 0.0                                       # never negative
    one = ForwardCost({(1, 1): 0.5, (8, 1): 1.2})                  # one token measured: flat in tokens
    assert one(8, 1) == one(8, 5) == pytest.approx(1.2)
    assert one(4, 3) == pytest.approx(0.5 + 0.7 * 3 / 7)
    with pytest.raises(ValueError):
        ForwardCost({(1, 1): 1.0, (1, 2): 1.0, (2, 1): 1.0})       # incomplete grid
    mono = ForwardCost({(1, 1): 1.0, (1, 5): 0.9, (4, 1): 0.5, (4, 5): 6.0}).monotone()
    assert mono.table == {(1, 1): 1.0, (1, 5): 1.0, (4, 1): 1.0, (4, 5): 6.0}


def test_best_k_by_length_maximises_tokens_per_second_at_one_row():
    T, D = _table(1e-2, 1.5e-3), _table(1e-3, 1e-4)
    for a in (0.3, 0.6, 0.8, 0.95):
        k, ewif = best_k("d", "t", {("t", "d"): a}, {}, 12, forward={"t": T, "d": D})
        rate = {j: expected_tokens(a, j) * T(1, 1) / (j * D(1, 1) + T(1, j + 1)) for j in range(1, 13)}
        assert ewif == pytest.approx(rate[k]) and rate[k] == max(rate.values())
    flat = best_k("d", "t", {("t", "d"): 0.8}, {"t": 1.0, "d": 0.1}, 12)[0]
    assert best_k("d", "t", {("t", "d"): 0.8}, {}, 12, forward={"t": T, "d": D})[0] < flat


def _mc_vouched(K, A, V, runs=30000, seed=5):
    """Tokens per step when a reviewer accepts a drafter's vouched tokens (the accepted part of its review step)
    at V and its own last token at A (bottom tokens: A)."""
    rng = random.Random(seed)
    n = len(K)

    def rate(r, tok):
        j, own = tok
        return A[r][j] if own or j == n - 1 else V[r][j]

    def draft(r):
        toks = []
        for j in range(r, n):
            if j == n - 1:
                toks += [(j, True)] * K[r][j]
            else:
                for _ in range(K[r][j]):
                    sub = draft(j + 1)
                    acc = _accept_prefix(rng, [rate(j + 1, t) for t in sub])
                    toks += [(j, False)] * acc + [(j, True)]
        return toks

    return sum(_accept_prefix(rng, [rate(0, t) for t in draft(0)]) + 1 for _ in range(runs)) / runs


@pytest.mark.parametrize("K", [[[2, 3], [0, 4]], [[1, 0, 2], [0, 2, 1], [0, 0, 3]]])
def test_vouched_tokens_match_monte_carlo(K):
    A = [[0.7, 0.5], [0.0, 0.4]] if len(K) == 2 else [[0.7, 0.6, 0.4], [0.0, 0.65, 0.5], [0.0, 0.0, 0.45]]
    V = [[0.95, 0.0], [0.0, 0.0]] if len(K) == 2 else [[0.9, 0.85, 0.0], [0.0, 0.8, 0.0], [0.0, 0.0, 0.0]]
    model = CascadeModel(K, A, [0.1] * len(K), vouched=V)
    assert model.tokens_per_step() == pytest.approx(_mc_vouched(K, A, V), rel=0.015)
    same = CascadeModel(K, A, [0.1] * len(K), vouched=A)          # v = alpha: the i.i.d. model
    assert same.tokens_per_step() == pytest.approx(CascadeModel(K, A, [0.1] * len(K)).tokens_per_step(), rel=1e-12)
    assert model.tokens_per_step() > same.tokens_per_step()


def test_positional_bottom_alphas_match_monte_carlo():
    """A bottom proposal whose t-th token is accepted w.p. alpha_t given the earlier ones."""
    pos = [0.5, 0.9, 0.8]
    K, A = [[2, 4], [0, 3]], [[0.7, pos], [0.0, [0.6, 0.7]]]
    rng = random.Random(6)

    def bottom(alphas, b):
        return [alphas[min(t, len(alphas) - 1)] for t in range(b)]

    total = 0
    for _ in range(30000):
        draft = []
        for _ in range(K[0][0]):
            acc = _accept_prefix(rng, bottom(A[1][1], K[1][1]))
            draft += [0.7] * (acc + 1)
        draft += bottom(pos, K[0][1])
        total += _accept_prefix(rng, draft) + 1
    assert CascadeModel(K, A, [0.1, 0.01]).tokens_per_step() == pytest.approx(total / 30000, rel=0.015)
    assert expected_tokens(pos, 3) == pytest.approx(1 + 0.5 + 0.45 + 0.36)
