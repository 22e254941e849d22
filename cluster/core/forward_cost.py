"""Measured forward costs and the draft length they imply: a model of one speculative step.

A :class:`ForwardCost` table holds the wall seconds of one batched forward by (rows, tokens fed per row), as
``specserve tune`` and ``specserve bench --suite gpu`` measure it; :func:`step_seconds` prices a speculative
step of k drafts from such tables (the production projection, :mod:`cluster.bench.projection`), and
:func:`best_k` picks the k that maximises expected tokens per second at one row for ``specserve tune`` (EWIF of
Chen et al., *Cascade Speculative Drafting for Even Faster LLM Inference*, Corollary 4.2, with each call's cost
read from the tables instead of a constant ratio).
"""
from __future__ import annotations

from typing import Mapping

from cluster.core.cost_model import ewif_speculative, expected_tokens


class ForwardCost:
    """Measured wall seconds of one batched forward pass of one model, per (rows, tokens per row).

    Built from a full grid ``{(rows, tokens): seconds}`` -- what
    :func:`cluster.bench.measure.forward_cost_grid` returns.  ``cost(rows, tokens)`` interpolates
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
                 call_cost: ForwardCost | None = None) -> float:
    """Modelled seconds of one speculative step over ``rows`` rows: k sequential drafter forwards of one
    token (none for a deterministic drafter: ``drafter_cost=None``), one target forward of k + 1 tokens
    per row, and, when k > 0, one draft-side call ``call_cost(rows, 1)`` (its round trip; None: drafting
    in-process).  Shared by the production projection and ``specserve tune``."""
    per_draft = 0.0 if drafter_cost is None else drafter_cost(rows, 1)
    per_call = 0.0 if call_cost is None or k == 0 else call_cost(rows, 1)
    return per_call + k * per_draft + target_cost(rows, k + 1)


def best_k(drafter, target, alphas, costs, k_max: int = 12, forward=None, overhead=(0.0, 0.0)):
    """(k, predicted EWIF) for plain speculative decoding with ``drafter`` (Corollary 4.2); with ``forward``
    (``{model: ForwardCost}``) the step of k drafts costs k drafter(1, 1) + target(1, k + 1)
    (:func:`step_seconds` at one row) plus ``overhead`` (per step, per draft token), over
    one plain decoding step."""
    a = alphas[(target, drafter)]
    if forward is None:
        c = costs[drafter] / costs[target]
        return max(((k, ewif_speculative(a, k, c)) for k in range(1, k_max + 1)), key=lambda t: t[1])
    T, D = forward[target], forward.get(drafter)
    o, eps = overhead
    return max(((k, expected_tokens(a, k) * (T(1, 1) + o) / (step_seconds(k, D, T, 1) + o + eps * k))
                for k in range(1, k_max + 1)), key=lambda t: t[1])
