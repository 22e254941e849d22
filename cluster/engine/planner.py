"""The load-aware planner: one draft length per drafter per engine step, chosen CLOSED LOOP from measured goodput.

A speculative step is worth its extra target tokens only while the target forward is cheap in tokens: a
batch of rows costs far less than its rows one by one, and at high batch a verification of k + 1 tokens
costs a multiple of a decoding step (the target's ``ForwardCost`` as :mod:`cluster.engine.measure` measures it;
``specserve bench --suite load`` measures it).  The open-loop cost model alone misprices a step (the drafter's catch-up
after plain steps, the engine's own work per round, round trips, noise), so the planner measures what its
choices really yield and moves toward what measures best, in the spirit of vLLM's batch-size-dependent draft
length and SGLang's adaptive speculation, of nano-PEARL's per-batch-size draft length (gamma) profile, and of
the adaptive draft length of Liu et al., *Parallel Speculative Decoding with Adaptive Draft Length* (PEARL).

Per step, :meth:`Planner.plan` groups the running requests whose strategy is load-aware
(``strategy.load_aware``, option ``plan=load_aware``) by drafter and chooses one k in 0..min(strategy.k)
per group; it sets ``seq.ctx.planned_k`` (the strategy caps it by the request's budget; 0 = plain decoding).

**Arms and bands** (:mod:`cluster.engine.arms`): the state is kept per (drafter, batch-size band), and within a
band per draft length k (an arm); bands learn independently, but a band the batch enters for the first time
starts from what the nearest band (at most two away) measured, arm by arm (:func:`cluster.engine.arms.nearby`).

**Prior.**  For the group's B_g rows with acceptance estimates alpha_i the cost model gives, per k, the
expected tokens per row and step ``E_k = mean_i (1 - alpha_i^(k+1)) / (1 - alpha_i)`` and the step seconds
``S_k = [k > 0] call(B_g) + k * drafter(B_g, 1) + target(B, k + 1)`` (call: one draft-side round trip, measured
where the draft side is another process; :func:`cluster.core.forward_cost.step_seconds`; forward
costs from :class:`ForwardCost` tables measured through the engine's own handles, :mod:`cluster.engine.measure`;
a drafter without a table -- the deterministic Max-Gram drafter -- drafts for free), so the prior goodput
is ``B_g * E_k / S_k`` tokens per second (the open-loop choice of
:func:`cluster.core.forward_cost.plan_draft_length`); it decides only arms that no band near has measured.

**Measurement.**  :meth:`Planner.observe` receives the step's wall time (the engine's: from the plan to the
next step; a late drafter prefill in it is replaced by its share per token, :meth:`prefilled`); the tokens
the step committed are read at the next plan from the growth of each row's ``ctx.stats.generated_tokens``,
over the rows that ran the planned k in full (not a request's last steps, cut by its budget).  The arm gets
two samples: committed tokens per row (which calibrate the acceptance model, ``Acceptance.scale``) and real /
modelled step seconds, which carry what the forward costs miss (the engine's own work, round trips).  The step where a
drafter's k changes gives no time sample: its draft call first catches the drafter up on the tokens of the
plain steps before it, and had no block pre-drafted during the last verification (separated topology), so
it costs what switching costs, not what k costs; a one-step probe would be only such a step; hence runs of ``probe_run`` plans.

**Choice** (:func:`cluster.engine.arms.choose`): the best measured goodput estimate
``B_g * E_k / (S_k * R_k)``, the cost model standing in for arms with too few samples; k > 0 must beat
k = 0 by ``margin`` (10 %: measured in-process at 32 rows, a speculating arm within a few percent of plain
decoding flipped the band back and forth on timing noise, and each flip paid a catch-up).

**Probing.**  Every ``interval``-th plan of a band (``probe_every`` at first) starts a run of ``probe_run``
plans of a neighbour of the current best instead (best + 1, best - 1, 0, k_max in turn), judged on its last
plan; a probe of an arm whose estimate (with measured time ratios) is below ``probe_floor`` of the best's
is skipped and counts as lost.  The only quicker probes, 2 plans later, follow a probe that won -- beat the
best's estimate by ``margin``: in a band where arms tie within timing noise, probes that won by less reset the
interval again and again, each paying a catch-up -- (one further the same way: hill climbing) or one of an arm
with fewer than ``prior_samples`` samples (the same arm again; at most ``prior_samples`` per arm and band); when
every neighbour has been tried and lost, the interval doubles, up to ``probe_every * backoff``, and a new best
resets it.  A band that decodes plainly starts a scheduled probe only while its probe runs (and their switches
back) have taken at most its share of its observed wall time -- ``probe_budget``, shrunk as its probe interval
backs off (:func:`cluster.engine.arms.affordable`): a probe's first step pays what no time sample shows, the
drafters' catch-up on every token they missed.  Where speculation does not pay (high batch) the band settles on
k = 0 and probes ever more rarely.  Everything is counters, means and medians: the same observations give the
same plans (no clock, no randomness).

**Acceptance** (E_k): per request, shrunk toward its drafter's (:mod:`cluster.engine.acceptance`).  The measuring
lives with the caller (:func:`cluster.engine.measure.build_planner`, called by both roots); given a ``measure``
callable instead of costs, the planner measures on the first step that plans.
"""
from __future__ import annotations

import logging
import statistics
from collections import Counter, deque

from cluster.core.cost_model import expected_tokens
from cluster.core.forward_cost import ForwardCost, step_seconds
from cluster.core.draft.programs import DRAFTS
from cluster.engine.acceptance import PRIOR_ALPHA, PRIOR_WEIGHT, Acceptance
from cluster.engine.arms import (BANDS, Band, Pending, affordable, band_of, choose, estimate, nearby, neighbours,
                                 prefill_share)

log = logging.getLogger("specserve.planner")

__all__ = ["BANDS", "Planner", "band_of", "is_planned"]


def is_planned(seq) -> bool:
    """Whether ``seq``'s strategy takes its draft length from the planner (option ``plan=load_aware``)."""
    return getattr(seq.req.strategy, "load_aware", False)


class Planner:
    """Chooses each step's draft length per drafter from measured goodput, with the cost model as the prior.

    ``costs`` maps model names to :class:`ForwardCost` tables and must hold ``target`` -- or is None with
    ``measure`` (a callable returning such a dict), called on the first step that plans (retried every
    ``retry_every`` plans if it fails; until then load-aware requests decode plainly).  Readable: ``history``
    (recent ``(batch size, k)`` choices, one per planned group and step), ``counts`` (batch size -> Counter of
    k), ``last`` (drafter -> (batch size, k, mean alpha) of its latest plan), :meth:`alpha`, :meth:`report`.
    """

    def __init__(self, costs: dict[str, ForwardCost] | None, target: str, *, measure=None,
                 prior_alpha: float = PRIOR_ALPHA, prior_weight: float = PRIOR_WEIGHT, probe_every: int = 8,
                 backoff: int = 16, window: int = 12, prior_samples: int = 2, margin: float = 0.10, memory: int = 4096,
                 history: int = 10000, retry_every: int = 64, probe_run: int = 3, probe_floor: float = 0.5,
                 probe_budget: float = 0.1):
        if costs is None and measure is None:
            raise ValueError("Planner: give costs or a measure callable")
        if costs is not None and target not in costs:
            raise ValueError(f"Planner: costs must include the target {target!r}")
        if window < 1 or prior_samples < 0 or backoff < 1 or probe_every < 0 or probe_run < 1:
            raise ValueError("Planner: window >= 1, prior_samples >= 0, backoff >= 1, probe_every >= 0, "
                             "probe_run >= 1")
        self.acceptance = Acceptance(prior_alpha, prior_weight, memory)
        self.costs, self.target = dict(costs or {}), target
        self._measure, self.retry_every, self._retry_at, self._plans = measure, retry_every, 0, 0
        self.probe_every, self.backoff, self.window, self.prior_samples = probe_every, backoff, window, prior_samples
        self.margin, self.probe_run, self.probe_floor, self.probe_budget = margin, probe_run, probe_floor, probe_budget
        self._last_k: dict[str, int] = {}              # drafter -> the k of its group's previous plan
        self._last_probing: dict[str, bool] = {}       # drafter -> whether that plan was a probe's
        self.history: deque[tuple[int, int]] = deque(maxlen=history)
        self.counts: dict[int, Counter] = {}
        self.last: dict[str, tuple[int, int, float]] = {}
        self._bands: dict[tuple[str, int], Band] = {}
        self._pending: list[Pending] = []              # the last plan's groups, until their step is measured
        self._prefills: dict[str, deque] = {}          # drafter -> recent drafter-prefill seconds per request

    def alpha(self, drafter: str) -> float:
        """The drafter's global acceptance estimate (prior + finished + live requests)."""
        return self.acceptance.alpha(drafter)

    # -- the closed loop ----------------------------------------------------------------------------
    def observe(self, seconds: float) -> None:
        """The engine's wall time of the step just planned (its committed tokens are read at the next plan)."""
        for p in self._pending:
            if p.seconds is None:
                p.seconds = float(seconds)

    def prefilled(self, seqs, seconds: float = 0.0) -> None:
        """The engine prefilled the drafters of ``seqs`` (their first drafting step) inside the step just planned,
        in ``seconds``: a cost of drafting at all, paid once per request, which time samples carry spread over
        each request's tokens (:func:`cluster.engine.arms.prefill_share`), not whole or not at all (left out, it
        hid the cost where requests join on nearly every step: at high batch)."""
        ids, per_row = {id(s) for s in seqs}, float(seconds) / max(len(seqs), 1)
        for p in self._pending:                          # each drafter's group owes its own rows' part
            if n := sum(id(s) in ids for s, _ in p.rows):
                p.prefill += per_row * n
                self._prefills.setdefault(p.key[0], deque(maxlen=64)).append(per_row)

    def _settle(self) -> None:
        """Turn the measured pending plans into samples: tokens committed per row, real / modelled seconds."""
        pending, self._pending = self._pending, []
        for p in pending:
            if p.seconds is not None and p.seconds > 0:   # what exploring costs, against all the band's time
                band = self._bands[p.key]
                band.seconds += p.seconds
                if p.probing:
                    band.probe_seconds += p.seconds
            if p.seconds is None or p.seconds <= 0 or p.modelled[p.k] <= 0 or not p.rows:
                continue                                 # never observed (the step failed), or no row ran k
            tokens = sum(s.ctx.stats.generated_tokens - before for s, before in p.rows)
            if tokens <= 0:
                continue
            band, tokens = self._bands[p.key], tokens / len(p.rows)
            band.tokens.setdefault(p.k, deque(maxlen=self.window)).append(tokens)
            if p.k > 0:                                  # drafted tokens committed vs the model's (unscaled)
                self.acceptance.drafted(p.key[0], tokens - 1.0, (p.expected[p.k] - 1.0) / p.scale)
            if not p.switched:                           # a switch's step is not what k costs (docstring)
                band.times.setdefault(p.k, deque(maxlen=self.window)).append(
                    (p.seconds - p.prefill + prefill_share(p, statistics.fmean(self._prefills.get(p.key[0]) or [0.0])))
                    / p.modelled[p.k])
            band.samples[p.k] += 1
            if p.probe_at is not None:                   # a probe: back off unless it beats the best by the margin
                won = estimate(band, p, p.k, self.prior_samples) > \
                    estimate(band, p, p.best, self.prior_samples) * (1.0 + self.margin)
                fresh = len(band.times.get(p.k, ())) < max(self.prior_samples, 1)
                if won:                                  # hill-climb: next, one further the same way
                    band.interval, band.again = self.probe_every, p.k + (1 if p.k > p.best else -1)
                elif fresh:                              # too few samples to tell: the same k again
                    band.again = p.k
                elif band.turn % band.cycle == 0:        # every neighbour tried and lost: back off
                    band.interval = min(band.interval * 2, self.probe_every * self.backoff)
                band.next_probe = p.probe_at + (2 if won or fresh else band.interval)

    def report(self) -> dict[tuple[str, str], dict]:
        """Per (drafter, band): the current best k, probes so far, and per measured k (samples, mean tokens
        per row and step, median real / modelled step seconds)."""
        return {(d, BANDS[b]): {"best": band.best, "probes": band.probes,
                                "arms": {k: (band.samples[k], statistics.fmean(band.tokens[k]),
                                             statistics.median(band.times[k])) for k in sorted(band.times)}}
                for (d, b), band in sorted(self._bands.items())}

    # -- the plan -----------------------------------------------------------------------------------
    def ready(self) -> bool:
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

    def plan(self, running, stuck=None) -> None:
        """Set ``seq.ctx.planned_k`` for every running sequence whose strategy is load-aware, but those that
        ``stuck(seq)`` says step target-only whatever is planned (a model down).  A request whose drafters
        hold no state yet is planned too: the engine prefills them only when it drafts."""
        self._settle()
        by_drafter: dict[str, list] = {}
        for seq in running:
            if is_planned(seq) and not (stuck is not None and stuck(seq)):
                by_drafter.setdefault(seq.req.strategy.drafter, []).append(seq)
        self.acceptance.retire({id(s) for g in by_drafter.values() for s in g})
        if not by_drafter:
            return
        self._plans += 1
        ready, batch = self.ready(), len(running)
        for drafter, seqs in by_drafter.items():
            for seq in seqs:
                self.acceptance.read(seq, drafter)
            g = self.alpha(drafter)
            alphas = [self.acceptance.of(s, g) for s in seqs]
            k = self._plan_group(drafter, seqs, alphas, batch) if ready else 0
            for seq in seqs:
                seq.ctx.planned_k = k
            self.history.append((batch, k))
            self.counts.setdefault(batch, Counter())[k] += 1
            self.last[drafter] = (batch, k, sum(alphas) / len(alphas))

    def _hopeless(self, band, p, cand: int, best: int) -> bool:
        """A probe not worth its run: once the band has ``prior_samples`` time samples of some k > 0 (one can be a
        cold start, which kept a cascade's band plain for good), an arm estimated below ``probe_floor`` of the
        best's goodput (at high batch a run of the longest draft can cost tens of plain steps and not win)."""
        ps = self.prior_samples
        if not any(len(band.times.get(j, ())) >= max(ps, 1) for j in range(1, len(p.modelled))):
            return False                                 # the prior alone decides nothing here: probe
        return estimate(band, p, cand, ps) < self.probe_floor * estimate(band, p, best, ps)

    def _plan_group(self, drafter: str, seqs: list, alphas: list[float], batch: int) -> int:
        k_max = max(0, min(s.req.strategy.k for s in seqs))
        drafter_cost, target_cost = self.costs.get(drafter), self.costs[self.target]
        key = (drafter, band_of(batch))
        band = self._bands.get(key)
        if band is None:
            band = self._bands[key] = Band(interval=self.probe_every, next_probe=self.probe_every)
        alphas = [min(1.0, max(0.0, a)) for a in alphas]
        f = self.acceptance.scale(drafter)
        p = Pending(key, 0, 0, [1.0 + f * (sum(expected_tokens(a, k) for a in alphas) / len(alphas) - 1.0)
                                for k in range(k_max + 1)],
                     [step_seconds(k, drafter_cost, target_cost, len(seqs), batch, self.costs.get(DRAFTS))
                      for k in range(k_max + 1)],
                     [(s, s.ctx.stats.generated_tokens) for s in seqs], scale=f)
        p.prior = nearby(self._bands, drafter, key[1], k_max, need=max(self.prior_samples, 1))
        best = choose(band, p, self.prior_samples, self.margin)
        if best != band.best:                            # a new best: look around it soon, upward first
            band.best, band.interval, band.turn = best, self.probe_every, 0
            band.next_probe = min(band.next_probe, band.plans + self.probe_every)
        band.plans += 1
        if band.seen != self._plans - 1:                 # the batch left this band meanwhile: the run is over
            band.run_left = 0
        band.seen = self._plans
        k, probe_at = best, None
        if band.run_left > 0 and band.run_k is not None and band.run_k <= k_max:     # a probe's run goes on
            k, band.run_left, p.probing = band.run_k, band.run_left - 1, True
            probe_at = band.plans if band.run_left == 0 else None
        elif k_max > 0 and self.probe_every and band.plans >= band.next_probe and (
                band.again is not None or best > 0 or
                affordable(band, self.probe_budget, self.probe_every)):
            if band.again is not None and 0 <= band.again <= k_max and band.again != best:
                cand = band.again
            else:
                around = neighbours(best, k_max)
                cand, band.cycle = around[band.turn % len(around)], len(around)
                band.turn += 1
            band.again = None
            band.next_probe = band.plans + max(band.interval, self.probe_run)
            if self._hopeless(band, p, cand, best):      # skipped, and counted as a probe that lost
                if band.turn % band.cycle == 0:
                    band.interval = min(band.interval * 2, self.probe_every * self.backoff)
            else:
                k, p.probing = cand, True
                band.probes += 1
                band.run_k, band.run_left = k, self.probe_run - 1
                probe_at = band.plans if band.run_left == 0 else None  # judged on the run's last step
        p.k, p.best, p.probe_at = k, best, probe_at
        p.switched = self._last_k.get(drafter, k) != k
        back = p.switched and self._last_probing.get(drafter, False)
        self._last_k[drafter], self._last_probing[drafter] = k, p.probing
        p.probing = p.probing or back                    # leaving a probe run pays its switch back too
        # a row whose remaining budget cuts the draft below k (its last steps) does not run arm k: its tokens
        # would sample a shorter draft as this one (and its faster step with them); the step's time stays a
        # sample while some row runs k in full
        p.rows = [(s, n) for s, n in p.rows if getattr(s.ctx, "budget", None) is None or s.ctx.budget - 1 >= k]
        self._pending.append(p)
        return k
