"""The load-aware planner: one draft length per drafter per engine step, chosen from the batch's load.

A speculative step is worth its extra target tokens only while the target forward is cheap in tokens:
batching 16 rows costs ~2.4x one row, and at high batch a 5-token verification costs ~1.8x a decoding
step (docs: /work/shared/design/batching-notes.md).  Like vLLM's batch-size-dependent draft length and
SGLang's adaptive speculation, the planner picks k from measured forward costs (:class:`ForwardCost`, one
table per model), the batch size and each request's acceptance estimate, via
:func:`cluster.core.cost_model.plan_draft_length`.

Per step, :meth:`Planner.plan` groups the running requests whose strategy is load-aware
(``strategy.load_aware``, option ``plan=load_aware``) by drafter and chooses one k in 0..min(strategy.k)
per group, with the drafter's cost over the group's rows and the target's over every running row (the
target forward is shared).  It sets ``seq.ctx.planned_k``; the strategy caps it by the request's budget.

Acceptance: under the i.i.d. model of the cost formula a step that drafted d and accepted a < d tokens
saw a accepts and one reject (positions after the first reject were never tried), so a request's
estimate is Beta-style, alpha_i = (g * w + accepts_i) / (w + accepts_i + rejects_i), shrunk toward the
drafter's global estimate g = (prior_alpha * w + A) / (w + A + R) over the live and recently finished
requests (w = prior_weight).  (accepted_tokens / drafted_tokens would understate alpha: at alpha = 0.8
and k = 4 it reads 0.59.)  A group that plans k = 0 learns nothing, so every ``probe_every``-th
consecutive k = 0 plan drafts one token instead.  The prior is optimistic (0.8: drafting is the point, and a
wrong optimistic prior is corrected within a few steps, while a pessimistic one only by the probes).  The measuring lives with the caller
(:func:`cluster.local.measure_planner`): the engine does not import models.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from cluster.core.cost_model import ForwardCost, plan_draft_length


@dataclass
class _Track:
    """What the planner has read of one request's stats: the raw counters and the derived trials."""

    drafter: str
    seq: object = None        # the sequence (held so its id stays unique while tracked)
    steps: int = 0
    accepted: int = 0
    drafted: int = 0
    accepts: int = 0          # tried positions accepted
    rejects: int = 0          # tried positions rejected (at most one per step)

    def update(self, stats) -> tuple[int, int]:
        """Fold the stats' growth since the last read in; returns the (accepts, rejects) it added."""
        ds, da, dd = stats.steps - self.steps, stats.accepted_tokens - self.accepted, \
            stats.drafted_tokens - self.drafted
        self.steps, self.accepted, self.drafted = stats.steps, stats.accepted_tokens, stats.drafted_tokens
        rej = min(max(ds, 0), max(dd - da, 0))     # exact for one step per plan (the engine's loop)
        self.accepts += max(da, 0)
        self.rejects += rej
        return max(da, 0), rej


class Planner:
    """Chooses each step's draft length per drafter from measured costs, batch size and acceptance.

    ``costs`` maps model names to :class:`ForwardCost` tables and must hold ``target``; a drafter without
    a table (the deterministic Max-Gram drafter) drafts for free.  Readable counters: ``history`` (recent
    ``(batch size, k)`` choices, one per planned group and step), ``counts`` (batch size -> Counter of k),
    ``last`` (drafter -> (batch size, k, mean alpha) of its latest plan) and :meth:`alpha`.
    """

    def __init__(self, costs: dict[str, ForwardCost], target: str, *, prior_alpha: float = 0.8,
                 prior_weight: float = 4.0, probe_every: int = 8, memory: int = 4096, history: int = 10000,
                 margin: float = 0.1):
        if target not in costs:
            raise ValueError(f"Planner: costs must include the target {target!r}")
        if not 0.0 <= prior_alpha <= 1.0 or prior_weight <= 0:
            raise ValueError("Planner: prior_alpha in [0, 1] and prior_weight > 0")
        self.costs, self.target = dict(costs), target
        self.prior_alpha, self.prior_weight = float(prior_alpha), float(prior_weight)
        self.probe_every, self.memory = probe_every, memory
        self.history: deque[tuple[int, int]] = deque(maxlen=history)
        self.counts: dict[int, Counter] = {}
        self.last: dict[str, tuple[int, int, float]] = {}
        self._tracks: dict[int, _Track] = {}           # id(live sequence) -> what was read of its stats
        self._retired: dict[str, list[float]] = {}     # drafter -> [accepts, rejects] of finished requests
        self._zero_run: dict[str, int] = {}            # drafter -> consecutive k = 0 plans
        self._ratio = {False: 1.0, True: 1.0}          # (k > 0) -> EMA of real / modelled step time
        self.margin = margin                           # speculate only for a modelled gain above this
        self._planned: tuple[int, float] | None = None  # (k, modelled seconds) of the largest group this step

    # -- acceptance ---------------------------------------------------------------------------------
    def alpha(self, drafter: str) -> float:
        """The drafter's global acceptance estimate (prior + finished + live requests)."""
        a, r = self._retired.get(drafter, (0.0, 0.0))
        for t in self._tracks.values():
            if t.drafter == drafter:
                a, r = a + t.accepts, r + t.rejects
        w = self.prior_weight
        return (self.prior_alpha * w + a) / (w + a + r)

    def _request_alpha(self, track: _Track, g: float) -> float:
        w = self.prior_weight
        return (g * w + track.accepts) / (w + track.accepts + track.rejects)

    def _retire(self, live: set[int]) -> None:
        """Fold the counts of requests no longer running into their drafter's totals (bounded memory)."""
        for key in [k for k in self._tracks if k not in live]:
            t = self._tracks.pop(key)
            tot = self._retired.setdefault(t.drafter, [0.0, 0.0])
            tot[0] += t.accepts
            tot[1] += t.rejects
            n = tot[0] + tot[1]
            if self.memory and n > self.memory:          # keep a recent average, not the all-time one
                tot[0], tot[1] = tot[0] * self.memory / n, tot[1] * self.memory / n

    def observe(self, seconds: float) -> None:
        """The engine's wall time of the step just planned: corrects the cost model, one ratio for plain steps
        (k = 0) and one for speculative steps (k > 0), so the choice follows real step times (drafter catch-up
        tokens, per-round engine work) rather than bare forward costs."""
        if self._planned is None:
            return
        k, modelled = self._planned
        self._planned = None
        if modelled > 0:
            self._ratio[k > 0] = 0.9 * self._ratio[k > 0] + 0.1 * (seconds / modelled)

    @property
    def scale(self) -> dict[str, float]:
        """The learned real/modelled step-time ratios, for reports."""
        return {"plain": self._ratio[False], "speculative": self._ratio[True]}

    # -- the plan -----------------------------------------------------------------------------------
    def plan(self, running) -> None:
        """Set ``seq.ctx.planned_k`` for every running sequence whose strategy is load-aware."""
        groups: dict[str, list] = {}
        for seq in running:
            strategy = seq.req.strategy
            if getattr(strategy, "load_aware", False):
                groups.setdefault(strategy.drafter, []).append(seq)
        self._retire({id(s) for g in groups.values() for s in g})
        if not groups:
            return
        target_cost, batch = self.costs[self.target], len(running)
        for drafter, seqs in groups.items():
            for seq in seqs:
                track = self._tracks.get(id(seq))
                if track is None or track.drafter != drafter:
                    track = self._tracks[id(seq)] = _Track(drafter, seq)
                track.update(seq.ctx.stats)
            g = self.alpha(drafter)
            alphas = [self._request_alpha(self._tracks[id(s)], g) for s in seqs]
            k_max = min(s.req.strategy.k for s in seqs)
            drafter_cost = self.costs.get(drafter)
            scale = {k: self._ratio[k > 0] for k in range(k_max + 1)}
            k = plan_draft_length(alphas, drafter_cost, target_cost, k_max, drafter_cost is None,
                                  target_rows=batch, scale=scale, margin=self.margin)
            if k == 0 and k_max > 0 and self.probe_every:
                self._zero_run[drafter] = self._zero_run.get(drafter, 0) + 1
                # refresh the estimate; rarer under load, where a probe (a catch-up forward of every row) costs most
                if self._zero_run[drafter] >= self.probe_every * max(1, len(seqs) // 4):
                    self._zero_run[drafter], k = 0, 1
            else:
                self._zero_run[drafter] = 0
            for seq in seqs:
                seq.ctx.planned_k = k
            if len(seqs) == batch:                       # the whole step is this group's: its time is k's
                per_draft = 0.0 if drafter_cost is None else drafter_cost(batch, 1)
                self._planned = (k, k * per_draft + target_cost(batch, k + 1))
            self.history.append((batch, k))
            self.counts.setdefault(batch, Counter())[k] += 1
            self.last[drafter] = (batch, k, sum(alphas) / len(alphas))
