"""The load-aware planner: one draft length per drafter per engine step, chosen CLOSED LOOP from measured goodput.

A speculative step is worth its extra target tokens only while the target forward is cheap in tokens:
batching 16 rows costs ~2.4x one row, and at high batch a 5-token verification costs ~1.8x a decoding
step (the target's ``ForwardCost`` as :mod:`cluster.engine.measure` measures it).  The open-loop cost
model alone misprices a step (the drafter's catch-up after plain steps, the engine's own work per round,
round trips, noise), so the planner measures what its choices really yield and moves toward what measures
best, in the spirit of vLLM's batch-size-dependent draft length and SGLang's adaptive speculation, of
nano-PEARL's per-batch-size draft length (gamma) profile, and of the adaptive draft length of Liu et al.,
*Parallel Speculative Decoding with Adaptive Draft Length* (PEARL).

Per step, :meth:`Planner.plan` groups the running requests whose strategy is load-aware
(``strategy.load_aware``, option ``plan=load_aware``) by drafter and chooses one k in 0..min(strategy.k)
per group; it sets ``seq.ctx.planned_k`` (the strategy caps it by the request's budget; 0 = plain decoding).

**Arms and bands.**  The state is kept per (drafter, batch-size band) -- bands of the running batch B:
1, 2-3, 4-7, 8-15, 16-31, 32+ (:data:`BANDS`) -- and within a band per draft length k (an arm).  Bands
learn independently: what pays at one row says nothing about 32 rows.

**Prior.**  For the group's B_g rows with acceptance estimates alpha_i the cost model gives, per k, the
expected tokens per row and step ``E_k = mean_i (1 - alpha_i^(k+1)) / (1 - alpha_i)`` and the step seconds
``S_k = [k > 0] call(B_g) + k * drafter(B_g, 1) + target(B, k + 1)`` (call: one draft-side round trip, measured
where the draft side is another process; :func:`cluster.core.cost_model.step_seconds`; forward
costs from :class:`ForwardCost` tables measured through the engine's own handles, :mod:`cluster.engine.measure`;
a drafter without a table -- the deterministic Max-Gram drafter -- drafts for free), so the prior goodput
is ``B_g * E_k / S_k`` tokens per second (the open-loop choice of
:func:`cluster.core.cost_model.plan_draft_length`).

**Measurement.**  :meth:`Planner.observe` receives the step's wall time; the tokens the step committed are
read from the growth of each row's ``ctx.stats.generated_tokens`` between one plan and the next (the engine
applies a step's tokens after ``observe``).  The arm that ran gets two samples: committed tokens per row, and
real / modelled step seconds.  Both are comparable across batch sizes and acceptance estimates within a band,
and the second carries what the forward costs miss (drafter catch-up, the engine's own work, round trips).

**Choice.**  The estimate of arm k is ``B_g * T_k / (S_k * R_k)``: T_k and R_k are the medians of the arm's
last ``window`` samples, topped up to ``prior_samples`` with pseudo-samples -- E_k for T; for R 1 when k = 0
or the band has measured no k > 0, else interpolated between the nearest measured k > 0 (draft lengths share
drafter and catch-up costs).  So the cost model decides until an arm has samples, and two samples decide.
The greedy choice is among k = 0 and the measured k > 0 (every k while the band has measured none); the best
k > 0 is taken only if it beats k = 0 by ``margin``; ties go to the smaller k.

**Probing.**  Every ``interval``-th plan of a band (``probe_every`` at first) runs a neighbour of the current
best instead (best + 1, best - 1, 0, k_max in turn).  The only quicker probes, 2 plans later, follow a probe that
won (one further the same way: hill climbing) or one of an arm with fewer than ``prior_samples`` samples
(the same arm again; at most ``prior_samples`` per arm and band); when every neighbour has been tried and
lost, the interval doubles, up to ``probe_every * backoff``, and a new best resets it.  Where speculation does not pay (high batch) the
band settles on k = 0 and probes k = 1 ever more rarely.  Everything is counters and medians: the same
observations give the same plans (no clock, no randomness).

**Acceptance** (feeds the prior): under the i.i.d. model a step that drafted d and accepted a < d tokens saw
a accepts and one reject, so a request's estimate is Beta-style, alpha_i = (g * w + accepts_i) /
(w + accepts_i + rejects_i), shrunk toward the drafter's global g = (prior_alpha * w + A) / (w + A + R) over
live and recently finished requests (w = prior_weight; accepted_tokens / drafted_tokens would understate
alpha: at alpha = 0.8 and k = 4 it reads 0.59).

The measuring lives with the caller (:func:`cluster.engine.measure.build_planner`, called by both roots);
given a ``measure`` callable instead of costs, the planner measures on the first step that plans.
"""
from __future__ import annotations

import logging
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

from cluster.core.cost_model import ForwardCost, expected_tokens, step_seconds
from cluster.core.drafting import DRAFTS

log = logging.getLogger("specserve.planner")

BANDS = ("1", "2-3", "4-7", "8-15", "16-31", "32+")


def band_of(batch: int) -> int:
    """The index in :data:`BANDS` of a running batch of ``batch`` rows."""
    return min(max(int(batch), 1).bit_length(), len(BANDS)) - 1


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


@dataclass
class _Band:
    """Closed-loop state of one (drafter, batch-size band)."""

    tokens: dict = field(default_factory=dict)   # k -> deque of recent committed tokens per row and step
    times: dict = field(default_factory=dict)    # k -> deque of recent real / modelled step seconds
    samples: Counter = field(default_factory=Counter)   # k -> samples ever taken
    plans: int = 0               # plans made in this band
    interval: int = 0            # plans between probes
    next_probe: int = 0          # plan number of the next probe
    turn: int = 0                # which neighbour the next probe tries (0 after a change of best)
    cycle: int = 1               # neighbours of the best at the last probe
    again: int | None = None     # the k the next probe tries (None: the next neighbour in turn)
    best: int = 0
    probes: int = 0


@dataclass
class _Pending:
    """One group's plan, waiting for its step's wall time and committed tokens."""

    key: tuple[str, int]
    k: int
    best: int
    expected: list[float]        # modelled tokens per row and step, per k (the acceptance model)
    modelled: list[float]        # modelled step seconds, per k (the forward costs)
    rows: list[tuple[object, int]]   # (sequence, generated tokens at plan time)
    probe_at: int | None = None  # the band's plan number, for a probe
    seconds: float | None = None


class Planner:
    """Chooses each step's draft length per drafter from measured goodput, with the cost model as the prior.

    ``costs`` maps model names to :class:`ForwardCost` tables and must hold ``target`` -- or is None with
    ``measure`` (a callable returning such a dict), called on the first step that plans (retried every
    ``retry_every`` plans if it fails; until then load-aware requests decode plainly).  Readable: ``history``
    (recent ``(batch size, k)`` choices, one per planned group and step), ``counts`` (batch size -> Counter of
    k), ``last`` (drafter -> (batch size, k, mean alpha) of its latest plan), :meth:`alpha`, :meth:`report`.
    """

    def __init__(self, costs: dict[str, ForwardCost] | None, target: str, *, measure=None,
                 prior_alpha: float = 0.8, prior_weight: float = 4.0, probe_every: int = 8, backoff: int = 16,
                 window: int = 12, prior_samples: int = 2, margin: float = 0.05, memory: int = 4096,
                 history: int = 10000, retry_every: int = 64):
        if costs is None and measure is None:
            raise ValueError("Planner: give costs or a measure callable")
        if costs is not None and target not in costs:
            raise ValueError(f"Planner: costs must include the target {target!r}")
        if not 0.0 <= prior_alpha <= 1.0 or prior_weight <= 0:
            raise ValueError("Planner: prior_alpha in [0, 1] and prior_weight > 0")
        if window < 1 or prior_samples < 0 or backoff < 1 or probe_every < 0:
            raise ValueError("Planner: window >= 1, prior_samples >= 0, backoff >= 1, probe_every >= 0")
        self.costs, self.target = dict(costs or {}), target
        self._measure, self.retry_every, self._retry_at, self._plans = measure, retry_every, 0, 0
        self.prior_alpha, self.prior_weight = float(prior_alpha), float(prior_weight)
        self.probe_every, self.backoff, self.window, self.prior_samples = probe_every, backoff, window, prior_samples
        self.margin, self.memory = margin, memory
        self.history: deque[tuple[int, int]] = deque(maxlen=history)
        self.counts: dict[int, Counter] = {}
        self.last: dict[str, tuple[int, int, float]] = {}
        self._tracks: dict[int, _Track] = {}           # id(live sequence) -> what was read of its stats
        self._retired: dict[str, list[float]] = {}     # drafter -> [accepts, rejects] of finished requests
        self._bands: dict[tuple[str, int], _Band] = {}
        self._pending: list[_Pending] = []             # the last plan's groups, until their step is measured

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

    # -- the closed loop ----------------------------------------------------------------------------
    def observe(self, seconds: float) -> None:
        """The engine's wall time of the step just planned (its committed tokens are read at the next plan)."""
        for p in self._pending:
            if p.seconds is None:
                p.seconds = float(seconds)

    def _settle(self) -> None:
        """Turn the measured pending plans into samples: tokens committed per row, real / modelled seconds."""
        pending, self._pending = self._pending, []
        for p in pending:
            if p.seconds is None or p.seconds <= 0 or p.modelled[p.k] <= 0:
                continue                                 # never observed (the step failed): no sample
            tokens = sum(s.ctx.stats.generated_tokens - before for s, before in p.rows)
            if tokens <= 0:
                continue
            band = self._bands[p.key]
            band.tokens.setdefault(p.k, deque(maxlen=self.window)).append(tokens / len(p.rows))
            band.times.setdefault(p.k, deque(maxlen=self.window)).append(p.seconds / p.modelled[p.k])
            band.samples[p.k] += 1
            if p.probe_at is not None:                   # a probe: back off unless it beats the best
                won = self._estimate(band, p, p.k) > self._estimate(band, p, p.best)
                fresh = len(band.times[p.k]) < max(self.prior_samples, 1)
                if won:                                  # hill-climb: next, one further the same way
                    band.interval, band.again = self.probe_every, p.k + (1 if p.k > p.best else -1)
                elif fresh:                              # too few samples to tell: the same k again
                    band.again = p.k
                elif band.turn % band.cycle == 0:        # every neighbour tried and lost: back off
                    band.interval = min(band.interval * 2, self.probe_every * self.backoff)
                band.next_probe = p.probe_at + (2 if won or fresh else band.interval)

    def _estimate(self, band: _Band, p: _Pending, k: int) -> float:
        """Goodput of draft length k at this step: committed tokens per second, rows * T_k / (S_k * R_k), with
        the modelled step seconds S_k and, per arm, T_k the median of recent tokens per row and R_k of recent
        real / modelled seconds, each topped up to ``prior_samples`` with pseudo-samples (T: the acceptance
        model's; R: 1 for k = 0, else borrowed from the measured k > 0, see :meth:`_borrow`)."""
        need = max(self.prior_samples, 1)
        tok, tim = list(band.tokens.get(k, ())), list(band.times.get(k, ()))
        if len(tok) < need:
            tok += [p.expected[k]] * (need - len(tok))
        if len(tim) < need:
            tim += [self._borrow(band, k) if k > 0 else 1.0] * (need - len(tim))
        return len(p.rows) * statistics.median(tok) / max(p.modelled[k] * statistics.median(tim), 1e-12)

    @staticmethod
    def _borrow(band: _Band, k: int) -> float:
        """The time ratio an unmeasured k > 0 borrows: linear between the nearest measured k > 0 below and
        above it (the nearer one's beyond them), 1 (the cost model) when no k > 0 is measured."""
        near = {j: statistics.median(r) for j, r in band.times.items() if j > 0 and j != k and r}
        lo, hi = max((j for j in near if j < k), default=None), min((j for j in near if j > k), default=None)
        if lo is not None and hi is not None:
            return near[lo] + (near[hi] - near[lo]) * (k - lo) / (hi - lo)
        return near[lo] if lo is not None else near[hi] if hi is not None else 1.0

    def _choose(self, band: _Band, p: _Pending) -> int:
        """The best k by estimate among k = 0 and the measured k > 0 (every k while no k > 0 is measured:
        the prior decides); other draft lengths are reached by probes only."""
        est = [self._estimate(band, p, k) for k in range(len(p.modelled))]
        measured = [k for k in range(1, len(est)) if band.times.get(k)]
        arms = measured if measured else range(1, len(est))
        if not arms:
            return 0
        best = max(arms, key=lambda k: (est[k], -k))                   # ties: the smaller k
        return best if est[best] > est[0] * (1.0 + self.margin) * (1.0 + 1e-9) else 0

    @staticmethod
    def _neighbours(best: int, k_max: int) -> list[int]:
        """Probe order around the best: one up, one down, plain decoding, and the longest draft -- goodput
        need not be concave in k (a draft-side round trip is paid once per step, whatever k: k = 1 can lose
        to k = 0 while k = 4 wins), so a walk over neighbours alone can stall at k = 0."""
        out = [k for k in (best + 1, best - 1, 0, k_max) if 0 <= k <= k_max and k != best]
        return list(dict.fromkeys(out)) or [best]

    def report(self) -> dict[tuple[str, str], dict]:
        """Per (drafter, band): the current best k, probes so far, and per measured k (samples, median tokens
        per row and step, median real / modelled step seconds)."""
        return {(d, BANDS[b]): {"best": band.best, "probes": band.probes,
                                "arms": {k: (band.samples[k], statistics.median(band.tokens[k]),
                                             statistics.median(band.times[k])) for k in sorted(band.times)}}
                for (d, b), band in sorted(self._bands.items())}

    # -- the plan -----------------------------------------------------------------------------------
    def _ready(self) -> bool:
        """Whether forward costs are known (measuring them now if a ``measure`` callable is due)."""
        if self.target in self.costs:
            return True
        if self._measure is None or self._plans < self._retry_at:
            return False
        try:
            costs = dict(self._measure())
            if self.target not in costs:
                raise ValueError(f"no cost table for the target {self.target!r}")
            self.costs = costs
            return True
        except Exception as e:                           # noqa: BLE001 - plain decoding until it works
            log.warning("load-aware planner: measuring forward costs failed (%s); plain decoding, retry in "
                        "%d plans", e, self.retry_every)
            self._retry_at = self._plans + self.retry_every
            return False

    def plan(self, running) -> None:
        """Set ``seq.ctx.planned_k`` for every running sequence whose strategy is load-aware."""
        self._settle()
        groups: dict[str, list] = {}
        for seq in running:
            strategy = seq.req.strategy
            if getattr(strategy, "load_aware", False):
                groups.setdefault(strategy.drafter, []).append(seq)
        self._retire({id(s) for g in groups.values() for s in g})
        if not groups:
            return
        self._plans += 1
        ready, batch = self._ready(), len(running)
        for drafter, seqs in groups.items():
            for seq in seqs:
                track = self._tracks.get(id(seq))
                if track is None or track.drafter != drafter:
                    track = self._tracks[id(seq)] = _Track(drafter, seq)
                track.update(seq.ctx.stats)
            g = self.alpha(drafter)
            alphas = [self._request_alpha(self._tracks[id(s)], g) for s in seqs]
            k = self._plan_group(drafter, seqs, alphas, batch) if ready else 0
            for seq in seqs:
                seq.ctx.planned_k = k
            self.history.append((batch, k))
            self.counts.setdefault(batch, Counter())[k] += 1
            self.last[drafter] = (batch, k, sum(alphas) / len(alphas))

    def _plan_group(self, drafter: str, seqs: list, alphas: list[float], batch: int) -> int:
        k_max = max(0, min(s.req.strategy.k for s in seqs))
        drafter_cost, target_cost = self.costs.get(drafter), self.costs[self.target]
        key = (drafter, band_of(batch))
        band = self._bands.get(key)
        if band is None:
            band = self._bands[key] = _Band(interval=self.probe_every, next_probe=self.probe_every)
        alphas = [min(1.0, max(0.0, a)) for a in alphas]
        p = _Pending(key, 0, 0, [sum(expected_tokens(a, k) for a in alphas) / len(alphas) for k in range(k_max + 1)],
                     [step_seconds(k, drafter_cost, target_cost, len(seqs), batch, self.costs.get(DRAFTS))
                      for k in range(k_max + 1)],
                     [(s, s.ctx.stats.generated_tokens) for s in seqs])
        best = self._choose(band, p)
        if best != band.best:                            # a new best: look around it soon, upward first
            band.best, band.interval, band.turn = best, self.probe_every, 0
            band.next_probe = min(band.next_probe, band.plans + self.probe_every)
        band.plans += 1
        k, probe_at = best, None
        if k_max > 0 and self.probe_every and band.plans >= band.next_probe:
            if band.again is not None and 0 <= band.again <= k_max and band.again != best:
                k = band.again
            else:
                around = self._neighbours(best, k_max)
                k, band.cycle = around[band.turn % len(around)], len(around)
                band.turn += 1
            band.again = None
            band.probes += 1
            probe_at = band.plans
            band.next_probe = band.plans + band.interval
        p.k, p.best, p.probe_at = k, best, probe_at
        self._pending.append(p)
        return k
