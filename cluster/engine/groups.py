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
the draft side drafts ahead and two drafting rows run, ``auto`` per batch-size band (:data:`cluster.engine.arms.BANDS`)
from measured step costs: each arm's committed tokens per second of engine step in that band, tried in turn
(closed loop, as the planner's arms: :mod:`cluster.engine.planner`), where the planner's forward-cost tables
(:mod:`cluster.engine.measure`, :func:`grouped_gain`) do not already rule it out.  Why measured and not modelled
alone: what decides is whether the second core is spare -- the tables, measured one model at a time, cannot see
the speculator's drafting slow the target's verification down when it is not (docs/cluster.md, "Two groups").
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field

from cluster.core.cost_model import expected_tokens
from cluster.core.draft.programs import DRAFTS
from cluster.core.forward_cost import ForwardCost, step_seconds
from cluster.engine.arms import band_of

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


@dataclass
class _Band:
    """``auto``'s state for one drafter in one batch-size band: per arm (False: one group, True: two) the recent steps' committed
    tokens and seconds; the arm in use, and a trial's arm and steps left."""

    samples: dict = field(default_factory=lambda: {False: deque(maxlen=WINDOW), True: deque(maxlen=WINDOW)})
    best: bool = False
    trying: bool | None = None
    left: int = 0
    steps: int = 0
    next_trial: int = 0
    interval: int = 0
    ruled_out: bool = False            # the cost tables say two groups cannot pay here (a free drafter)

    def rate(self, arm: bool) -> float:
        got = self.samples[arm]
        seconds = sum(s for _, s in got)
        return sum(t for t, _ in got) / seconds if seconds > 0 else 0.0


WINDOW = 32        # steps per arm and band whose goodput counts
TRIAL = 12         # steps of a trial of an arm (its first step, a switch, gives no sample)
RETRY = 256        # steps in a band before the arm not in use is tried again (doubling while it loses)


class Groups:
    """Which running rows step now (see the module docstring).  ``mode``: ``auto`` | ``on`` | ``off``;
    ``margin``: the measured gain in goodput ``auto`` asks of two groups over one (timing noise).

    ``auto`` per (drafter, band), as the planner's arms: a band's first steps try one group, then two (``TRIAL`` steps each), and keep the arm of
    the higher goodput (committed tokens per second of engine step, over the last ``WINDOW`` steps of each arm,
    the first step after a switch left out); the other arm is tried again after ``RETRY`` steps of the band,
    the interval doubling while it loses.  Where the planner's forward-cost tables are already measured and model
    no gain (:func:`grouped_gain` <= 1: a drafter that costs nothing, as Max-Gram), two groups are not tried."""

    def __init__(self, mode: str = "off", *, margin: float = 0.05):
        if mode not in GROUPING:
            raise ValueError(f"Groups: mode must be one of {GROUPING}, got {mode!r}")
        self.mode, self.margin = mode, margin
        self._of: dict[str, int] = {}                  # rid -> its group (0 or 1), in joining order
        self.turn = 0                                  # the group that steps next
        self.bands: dict[int, _Band] = {}
        self.grouped_steps = self.steps = 0
        self._step: tuple | None = None                # the last step: ((drafter, band), arm, start, [(seq, generated)], switched)
        self._last_arm: bool | None = None
        self._key: tuple | None = None                 # the (drafter, band) of the last ``auto`` decision

    def pays(self, batch: int, side, planner, running) -> bool:
        """Whether ``batch`` running rows step in two groups: the draft side must draft ahead and some row draft
        (a strategy with a draft length); ``on``: then always; ``auto``: as the band's measurements say."""
        self._key = None
        if self.mode == "off" or batch < 2 or not getattr(side, "drafts_ahead", False):
            return False
        drafting = [s.req.strategy for s in running if getattr(s.req.strategy, "k", 0) > 0]
        if not drafting:                               # nothing to draft ahead (autoregressive rows)
            return False
        if self.mode == "on":
            return True
        drafter = getattr(drafting[0], "drafter", None) or ""
        b = self.bands.setdefault((drafter, band_of(batch)), _Band(interval=RETRY))
        self._key = (drafter, band_of(batch))
        if not b.steps and planner is not None and planner.costs.get(planner.target) is not None:
            k = max(1, min(st.k for st in drafting))
            b.ruled_out = grouped_gain(planner.costs, planner.target, drafter, batch, k, planner.alpha(drafter)) <= 1
        b.steps += 1
        if b.ruled_out:
            return False
        if b.trying is not None and b.left > 0:
            b.left -= 1
            return b.trying
        if b.trying is not None:                       # a trial ended: keep the better arm
            self._decide(b)
        want = next((arm for arm in (False, True) if len(b.samples[arm]) < TRIAL // 2), None)
        if want is None and b.steps >= b.next_trial:
            want = not b.best
        if want is not None:
            b.trying, b.left = want, TRIAL - 1
            return want
        return b.best

    def _decide(self, b: _Band) -> None:
        tried, b.trying = b.trying, None
        before = b.best
        if b.samples[False] and b.samples[True]:
            b.best = b.rate(True) > b.rate(False) * (1.0 + self.margin)
        if tried != before and b.best == before and len(b.samples[tried]) >= TRIAL // 2:
            b.interval = min(b.interval * 2, RETRY * 16)   # the other arm lost again: try it more rarely
        elif b.best != before:
            b.interval = RETRY
        b.next_trial = b.steps + b.interval
        log.info("two groups: %.0f tok/s with, %.0f without -> %s", b.rate(True), b.rate(False),
                 "on" if b.best else "off")

    def observe(self, now: float) -> None:
        """The last step ended at ``now`` (the engine's clock, as the planner's): its committed tokens per second
        become a sample of its arm in its band, unless it switched arms."""
        step, self._step = self._step, None
        if step is None:
            return
        key, arm, start, rows, switched = step
        tokens = sum(len(s.generated) - n for s, n in rows)
        if not switched and now > start and tokens > 0 and key in self.bands:
            self.bands[key].samples[arm].append((tokens, now - start))

    def split(self, running: list, grouped: bool, fresh=(), now: float | None = None) -> tuple[list, list]:
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
        if now is not None and running:
            self._step = (self._key, grouped, now, [(s, len(s.generated)) for s in running],
                          self._last_arm is not None and self._last_arm != grouped)
            self._last_arm = grouped
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
