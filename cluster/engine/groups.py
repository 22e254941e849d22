"""Two groups: speculation that hides drafting on a spare core (issue 30 item 3).

Drafting after a verification needs that verification's outcome, so on a machine where the target is compute
bound the drafter waits for the target and the target for the drafter.  Split the running rows into two groups A
and B and step one group per engine step: while the target verifies group A's blocks, the draft side's far
speculator (a process of its own: :class:`cluster.core.draft.near_far.NearFarSide`) drafts group B's next
blocks from B's *committed* sequences -- known prefixes, no bet on an outcome, so every block is a cache hit if
it arrives in time -- and vice versa (Timor et al., *Distributed Speculative Inference*, speculation
parallelism: drafting overlapped with verification; McDanel et al., *AMUSD: Asynchronous Multi-Device
Speculative Decoding*, drafter and verifier running concurrently on separate devices).

Lossless by construction: grouping only decides *which* rows step when; each row's step is its strategy's
step, and a block drafted ahead is used only for exactly the committed sequence it was drafted from, with the
distribution it was drawn from (:meth:`cluster.core.draft.cache.SpeculationCache.take`); a late answer is
drafted near, as any miss.

Rows keep their group as they run: a row that joins goes to the smaller group; when rows leave and the groups
differ by more than one, the latest joined rows of the larger move over.  With one row there is no second
group and every row steps every step, as without groups.

When grouping pays is decided here only (:meth:`Groups.pays`): ``engine.groups`` ``off`` never, ``on`` whenever
the draft side drafts ahead and two rows run, ``auto`` per batch-size band (:data:`cluster.engine.arms.BANDS`)
from the planner's measured forward costs (:mod:`cluster.engine.measure`; :func:`grouped_gain`).
"""
from __future__ import annotations

import logging
import math

from cluster.core.cost_model import expected_tokens
from cluster.core.draft.programs import DRAFTS
from cluster.core.forward_cost import ForwardCost, step_seconds
from cluster.engine.arms import BANDS, band_of

log = logging.getLogger("specserve.groups")

GROUPING = ("auto", "on", "off")


def grouped_gain(costs: dict[str, ForwardCost], target: str, drafter: str, batch: int, k: int,
                 alpha: float) -> float:
    """Modelled goodput of two groups over one group for ``batch`` rows at draft length ``k`` and acceptance
    ``alpha`` (> 1: grouping pays).  One group: every row per step, the drafting on the step's critical path
    (:func:`cluster.core.forward_cost.step_seconds`).  Two groups: half the rows per step, the target's
    verification of k + 1 tokens per row plus the draft call; the drafting is hidden while the speculator's k
    drafter forwards over the other half take no longer than that verification, else it is on the path too
    (a late answer is drafted near)."""
    if batch < 2 or k < 1 or target not in costs:
        return 0.0
    drafter_cost, target_cost, call = costs.get(drafter), costs[target], costs.get(DRAFTS)
    tokens = expected_tokens(min(max(alpha, 0.0), 1.0), k)
    whole = batch * tokens / step_seconds(k, drafter_cost, target_cost, batch, batch, call)
    g = math.ceil(batch / 2)
    verify = target_cost(g, k + 1) + (0.0 if call is None else call(g, 1))
    draft = 0.0 if drafter_cost is None else k * drafter_cost(g, 1)
    grouped = g * tokens / (verify if draft <= verify else verify + draft)
    return grouped / whole


class Groups:
    """Which running rows step now (see the module docstring).  ``mode``: ``auto`` | ``on`` | ``off``;
    ``margin``: the modelled gain ``auto`` asks of grouping (timing noise in the cost tables)."""

    def __init__(self, mode: str = "off", *, margin: float = 0.10):
        if mode not in GROUPING:
            raise ValueError(f"Groups: mode must be one of {GROUPING}, got {mode!r}")
        self.mode, self.margin = mode, margin
        self._of: dict[str, int] = {}                  # rid -> its group (0 or 1), in joining order
        self.turn = 0                                  # the group that steps next
        self.decided: dict[int, bool] = {}             # band -> whether grouping pays there (auto)
        self.grouped_steps = self.steps = 0

    def pays(self, batch: int, side, planner, running) -> bool:
        """Whether ``batch`` running rows step in two groups: the draft side must draft ahead and some row draft
        (a strategy with a draft length); ``auto`` decides
        once per band from the planner's forward costs (measured now if they were not: a few seconds, once)."""
        if self.mode == "off" or batch < 2 or not getattr(side, "drafts_ahead", False):
            return False
        drafting = [s.req.strategy for s in running if getattr(s.req.strategy, "k", 0) > 0]
        if not drafting:                               # nothing to draft ahead (autoregressive rows)
            return False
        if self.mode == "on":
            return True
        band = band_of(batch)
        if band not in self.decided:
            if planner is None or not planner.ready():
                return False
            k = max(1, min(getattr(st, "k", 1) for st in drafting))
            drafter = getattr(drafting[0], "drafter", None) or ""
            gain = grouped_gain(planner.costs, planner.target, drafter, batch, k, planner.alpha(drafter))
            self.decided[band] = gain > 1.0 + self.margin
            log.info("two groups in band %s: modelled gain %.2f -> %s", BANDS[band], gain,
                     "on" if self.decided[band] else "off")
        return self.decided[band]

    def split(self, running: list, grouped: bool, fresh=()) -> tuple[list, list]:
        """-> (the rows that step now, the rows that step next).  Assigns joining rows, forgets the rows that
        left, rebalances; without ``grouped`` every row steps now.  ``fresh`` rows (joined this step) step now
        whatever their group: their first step is the target's alone (:mod:`cluster.engine.prefill`), so the
        first token does not wait for a group's turn."""
        live = {s.rid for s in running}
        for rid in [r for r in self._of if r not in live]:
            del self._of[rid]
        for s in running:
            if s.rid not in self._of:
                sizes = self._sizes()
                self._of[s.rid] = 0 if sizes[0] < sizes[1] else 1 if sizes[1] < sizes[0] else self.turn
        self._rebalance()
        self.steps += 1
        if not grouped:
            return list(running), []
        now = [s for s in running if self._of[s.rid] == self.turn]
        if not now:                                    # the group that was due has left: the other steps
            self.turn ^= 1
            now = [s for s in running if self._of[s.rid] == self.turn]
        fresh = {id(s) for s in fresh}
        now += [s for s in running if id(s) in fresh and self._of[s.rid] != self.turn]
        later = [s for s in running if self._of[s.rid] != self.turn and id(s) not in fresh]
        self.turn ^= 1
        self.grouped_steps += 1
        return now, later

    def group_of(self, rid: str) -> int | None:
        return self._of.get(rid)

    def _sizes(self) -> list[int]:
        sizes = [0, 0]
        for g in self._of.values():
            sizes[g] += 1
        return sizes

    def _rebalance(self) -> None:
        """While the groups differ by more than one row, the latest joined row of the larger moves over."""
        sizes = self._sizes()
        while abs(sizes[0] - sizes[1]) > 1:
            big = 0 if sizes[0] > sizes[1] else 1
            rid = next(r for r in reversed(list(self._of)) if self._of[r] == big)
            self._of[rid] = big ^ 1
            sizes[big], sizes[big ^ 1] = sizes[big] - 1, sizes[big ^ 1] + 1
