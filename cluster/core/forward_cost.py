"""Measured forward costs and the draft length they imply: the load-aware planner's model of a step.

A :class:`ForwardCost` table holds the wall seconds of one batched forward by (rows, tokens fed per row), as
:mod:`cluster.engine.measure` measures it through an engine's own handles; :func:`step_seconds` prices a
speculative step of k drafts from such tables, :func:`plan_draft_length` picks the open-loop k that
maximises expected tokens per second (EWIF of Chen et al., *Cascade Speculative Drafting for Even Faster LLM
Inference*, Corollary 4.2, with each call's cost read from the tables instead of a constant ratio), and
:func:`best_k` is that choice at one row for ``specserve tune``.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from cluster.core.cost_model import ewif_speculative, expected_tokens


class ForwardCost:
    """Measured wall seconds of one batched forward pass of one model, per (rows, tokens per row).

    Built from a full grid ``{(rows, tokens): seconds}`` -- what
    :func:`cluster.engine.measure.forward_cost_grid` returns.  ``cost(rows, tokens)`` interpolates
    piecewise linearly in rows and in tokens (bilinear on each grid cell), extrapolating linearly from the
    nearest cell beyond the grid; along an axis with a single measured value it is constant.  The result
    is never below zero.  Example: grid {(1, 1): 1.0, (1, 5): 2.0, (4, 1): 2.0, (4, 5): 6.0} gives
    cost(1, 3) = 1.5, cost(4, 3) = 4.0, cost(2, 3) = 1.5 + (4.0 - 1.5) / 3 = 2.333...
    """

    def __init__(self, table: Mapping[tuple[int, int], float]):
        if not table:
            raise ValueError("ForwardCost: empty table")
        self.rows = sorted({int(r) for r, _ in table})
        self.tokens = sorted({int(t) for _, t in table})
        missing = [(r, t) for r in self.rows for t in self.tokens if (r, t) not in table]
        if missing:
            raise ValueError(f"ForwardCost: the grid must be complete; missing {missing[:4]}")
        self.table = {(int(r), int(t)): float(s) for (r, t), s in table.items()}

    @classmethod
    def from_grid(cls, grid: Mapping[tuple[int, int], float]) -> "ForwardCost":
        return cls(grid)

    def __call__(self, rows: float, tokens: float) -> float:
        (r0, r1, wr), (t0, t1, wt) = _segment(self.rows, rows), _segment(self.tokens, tokens)
        g = self.table
        lo = g[(r0, t0)] + wt * (g[(r0, t1)] - g[(r0, t0)])
        hi = g[(r1, t0)] + wt * (g[(r1, t1)] - g[(r1, t0)])
        return max(0.0, lo + wr * (hi - lo))

    def monotone(self) -> "ForwardCost":
        """The table made non-decreasing in rows and in tokens (running maxima): timing noise must not
        make a larger forward look cheaper."""
        g = dict(self.table)
        for r in self.rows:
            for a, b in zip(self.tokens, self.tokens[1:]):
                g[(r, b)] = max(g[(r, b)], g[(r, a)])
        for t in self.tokens:
            for a, b in zip(self.rows, self.rows[1:]):
                g[(b, t)] = max(g[(b, t)], g[(a, t)])
        return ForwardCost(g)

    def __repr__(self) -> str:
        return f"ForwardCost(rows={self.rows}, tokens={self.tokens})"


def _segment(xs: list[int], x: float) -> tuple[int, int, float]:
    """(left, right, weight of right) of the grid segment holding ``x`` (the end segments beyond the grid,
    with weights outside [0, 1]: linear extrapolation)."""
    if len(xs) == 1:
        return xs[0], xs[0], 0.0
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    a, b = xs[i - 1], xs[i]
    return a, b, (x - a) / (b - a)


def step_seconds(k: int, drafter_cost: ForwardCost | None, target_cost: ForwardCost, rows: int,
                 target_rows: int | None = None, call_cost: ForwardCost | None = None) -> float:
    """Modelled seconds of one speculative step over ``rows`` rows: k sequential drafter forwards of one
    token (none for a deterministic drafter: ``drafter_cost=None``), one target forward of k + 1 tokens
    per row over ``target_rows`` (default ``rows``), and, when k > 0, one draft-side call ``call_cost(rows, 1)``
    (its round trip; None: drafting in-process).  Shared by the load-aware planner and ``specserve tune``."""
    per_draft = 0.0 if drafter_cost is None else drafter_cost(rows, 1)
    per_call = 0.0 if call_cost is None or k == 0 else call_cost(rows, 1)
    return per_call + k * per_draft + target_cost(rows if target_rows is None else target_rows, k + 1)


def plan_draft_length(alphas: Sequence[float], drafter_cost: ForwardCost | None, target_cost: ForwardCost,
                      k_max: int, deterministic_drafter: bool, *, target_rows: int | None = None,
                      scale: dict[int, float] | None = None, margin: float = 0.0) -> int:
    """One draft length k in 0..k_max for a batch of B = len(alphas) rows, maximizing expected generated
    tokens per second of one step (ties: the smaller k):

        k* = argmax_k  sum_i E(alpha_i, k) / (k * drafter_cost(B, 1) + target_cost(B_t, k + 1)),
        E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)

    (Leviathan et al. 2023, Fast Inference from Transformers via Speculative Decoding, eq. for expected
    tokens (1 - a^(k+1))/(1 - a)): k sequential drafter forwards over the B rows (the first one also feeds
    the pending tokens -- ignored) and one target forward of k + 1 tokens per row.  A deterministic
    drafter (Max-Gram) costs ~0, so the denominator is target_cost(B_t, k + 1) alone.  k = 0 is plain
    decoding: target_cost(B_t, 1) for one token per row.  ``target_rows`` (B_t, default B) is the target
    forward's batch when it is shared with rows outside this group.  ``scale[k]`` (default 1) multiplies the
    modelled step time of draft length k: the measured ratio of real step time to this model (catch-up tokens,
    the engine's own work per round), learned online by the planner.  ``margin``: speculate only when the
    best k > 0 beats plain decoding by more than this fraction (the model is an estimate; near a tie plain
    decoding is the safe choice).

    Worked example: 16 rows at alpha = 0.8, deterministic drafter, target_cost(16, t) = 10 ms + 1 ms * t:
    k = 0 gives 16 * 1 / 11 ms = 1.45 tokens/ms, k = 4 gives 16 * 3.36 / 15 ms = 3.59, k = 6 gives
    16 * 3.95 / 17 ms = 3.72 (the best), k = 8 gives 16 * 4.33 / 19 ms = 3.65: k* = 6.  At a load where a
    token costs 10 ms per row (10 ms + 10 ms * t): k = 0 -> 16 / 20 = 0.80, k = 1 -> 16 * 1.8 / 30 = 0.96,
    k = 2 -> 16 * 2.44 / 40 = 0.98, k = 3 -> 16 * 2.95 / 50 = 0.94: k* = 2.
    """
    if not alphas or k_max <= 0:
        return 0
    b = len(alphas)
    bt = b if target_rows is None else max(int(target_rows), b)
    alphas = [min(1.0, max(0.0, float(a))) for a in alphas]
    drafter_cost = None if deterministic_drafter else drafter_cost
    rates = []
    for k in range(k_max + 1):
        seconds = max(step_seconds(k, drafter_cost, target_cost, b, bt) * (scale or {}).get(k, 1.0), 1e-12)
        rates.append(sum(expected_tokens(a, k) for a in alphas) / seconds)
    best_k = max(range(1, k_max + 1), key=lambda k: (rates[k], -k))    # ties: the smaller k
    return best_k if rates[best_k] > rates[0] * (1.0 + margin) * (1.0 + 1e-9) else 0


def best_k(drafter, target, alphas, costs, k_max: int = 12, forward=None, overhead=(0.0, 0.0)):
    """(k, predicted EWIF) for plain speculative decoding with ``drafter`` (Corollary 4.2); with ``forward``
    (``{model: ForwardCost}``) the step of k drafts costs k drafter(1, 1) + target(1, k + 1) (the load-aware
    planner's model, :func:`step_seconds`, at one row) plus ``overhead`` (per step, per draft token), over
    one plain decoding step."""
    a = alphas[(target, drafter)]
    if forward is None:
        c = costs[drafter] / costs[target]
        return max(((k, ewif_speculative(a, k, c)) for k in range(1, k_max + 1)), key=lambda t: t[1])
    T, D = forward[target], forward.get(drafter)
    o, eps = overhead
    return max(((k, expected_tokens(a, k) * (T(1, 1) + o) / (step_seconds(k, D, T, 1) + o + eps * k))
                for k in range(1, k_max + 1)), key=lambda t: t[1])
