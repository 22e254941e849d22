"""The closed-loop state of the load-aware planner (:mod:`cluster.engine.planner`): per (drafter, batch-size
band) one arm per draft length k, and the goodput estimates it chooses by.

**Arms and bands.**  Bands of the running batch B: 1, 2-3, 4-7, 8-15, 16-31, 32+ (:data:`BANDS`) learn
independently: what pays at one row says nothing about 32 rows.  Within a band, arm k keeps its recent
samples of committed tokens per row and step (reported) and of real / modelled step
seconds, comparable across batch sizes within a band, which carry what the forward costs miss (drafter
catch-up, the engine's own work, round trips).

**Estimate.**  Goodput of arm k is ``B_g * E_k / (S_k * R_k)``: S_k the modelled step seconds, R_k the median
of the arm's last time samples, topped up to ``prior_samples`` with pseudo-samples, and E_k the acceptance
model's tokens per row and step (Leviathan et al., *Fast Inference from Transformers via Speculative Decoding*,
eq. 1: ``(1 - alpha^(k+1)) / (1 - alpha)``, the mean over the group's rows), each request's alpha estimated
from all its drafting steps (:mod:`cluster.engine.acceptance`), the drafted part scaled by the drafter's
measured / modelled drafted tokens over its last drafting steps in any band (``Acceptance.scale``: a cascade
drafts a block where the model counts k) -- not the arm's own last token samples: with a drafter whose
acceptance comes in stretches (Max-Gram), an arm's last samples are a few probe runs of correlated steps, and a
stretch of misses read as a k > 0 that commits little kept a band on plain decoding where fixed k won
(``specserve bench --suite load`` measures both).
Where a band of the same drafter at most two bands away has ``prior_samples`` time samples of arm k
(:func:`nearby`), R_k is the nearest such band's: a band the batch enters for the first time starts from what
its neighbour measured -- at 16 rows, that speculation lost at 8 -- rather than from the cost model, which
misprices a step the more the larger the batch (the engine's per-row work, the draft side's own cost, the load
of the machine).  Else 1 when k = 0 or the band has measured nothing, else interpolated between the nearest
measured k > 0 (draft lengths share drafter and catch-up costs), and where only k = 0 is measured, the ratio
that adds k = 0's excess seconds to k's modelled ones (:func:`borrow`).  So what was measured nearest decides
until an arm has samples, and two samples decide.

**Choice.**  Among k = 0 and the k > 0 measured in this band or a neighbouring one (every k while none
is); the best k > 0 only if it beats k = 0 by ``margin``; ties go to the smaller k.  A k > 0 replaces the
band's current best k > 0 only by beating it by half the margin: neighbouring draft lengths often measure within
timing noise of each other, and each flip of the best restarted the probing; plain decoding needs no such
lead, so leaving speculation stays immediate.  Other draft lengths are
reached by probes (:func:`neighbours`).
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

BANDS = ("1", "2-3", "4-7", "8-15", "16-31", "32+")


def band_of(batch: int) -> int:
    """The index in :data:`BANDS` of a running batch of ``batch`` rows."""
    return min(max(int(batch), 1).bit_length(), len(BANDS)) - 1


@dataclass
class Band:
    """Closed-loop state of one (drafter, batch-size band)."""

    tokens: dict = field(default_factory=dict)   # k -> deque of recent committed tokens per row and step
    times: dict = field(default_factory=dict)    # k -> deque of recent real / modelled step seconds
    samples: Counter = field(default_factory=Counter)   # k -> samples ever taken
    plans: int = 0               # plans made in this band
    run_k: int | None = None     # the k of the probe run under way
    run_left: int = 0            # its plans still to come
    seen: int = -1               # the planner's plan number when this band last planned
    interval: int = 0            # plans between probes
    next_probe: int = 0          # plan number of the next probe
    turn: int = 0                # which neighbour the next probe tries (0 after a change of best)
    cycle: int = 1               # neighbours of the best at the last probe
    again: int | None = None     # the k the next probe tries (None: the next neighbour in turn)
    best: int = 0
    probes: int = 0
    seconds: float = 0.0         # wall seconds of the band's observed steps
    probe_seconds: float = 0.0   # ... of those that ran a probe or switched back from one (exploring)


@dataclass
class Pending:
    """One group's plan, waiting for its step's wall time and committed tokens."""

    key: tuple[str, int]
    k: int
    best: int
    expected: list[float]        # modelled tokens per row and step, per k (the acceptance model)
    modelled: list[float]        # modelled step seconds, per k (the forward costs)
    rows: list[tuple[object, int]]   # (sequence, generated tokens at plan time)
    probe_at: int | None = None  # the band's plan number, for a probe
    seconds: float | None = None
    switched: bool = False       # this drafter's k differs from its previous plan's (no time sample)
    prior: dict = field(default_factory=dict)   # k -> the time ratio the nearest band measured
    probing: bool = False        # a step of a probe run, or the switch back from one
    prefill: float = 0.0         # seconds the step spent prefilling joining requests' drafters
    scale: float = 1.0           # the drafter's measured / modelled drafted tokens the expected ones carry


def estimate(band: Band, p: Pending, k: int, prior_samples: int) -> float:
    """Goodput of draft length k at this step (committed tokens per second), as the module docstring says."""
    need = max(prior_samples, 1)
    tim = list(band.times.get(k, ()))
    near = p.prior.get(k)
    if len(tim) < need:
        tim += [near if near is not None else borrow(band, p, k) if k > 0 else 1.0] * (need - len(tim))
    return len(p.rows) * p.expected[k] / max(p.modelled[k] * statistics.median(tim), 1e-12)


def borrow(band: Band, p: Pending, k: int) -> float:
    """The time ratio an unmeasured k > 0 borrows: linear between the nearest measured k > 0 below and above
    it (the nearer one's beyond them); where no k > 0 is measured, the ratio that adds plain decoding's excess
    seconds over its modelled ones to k's modelled seconds (the engine's per-row work adds to a step rather than
    multiplying it: lent as the cost model's ratio 1, an unmeasured k > 0 looked better than plain decoding where
    it was not); 1 (the cost model) when nothing is measured."""
    near = {j: statistics.median(r) for j, r in band.times.items() if j > 0 and j != k and r}
    lo, hi = max((j for j in near if j < k), default=None), min((j for j in near if j > k), default=None)
    if lo is not None and hi is not None:
        return near[lo] + (near[hi] - near[lo]) * (k - lo) / (hi - lo)
    if lo is not None or hi is not None:
        return near[lo] if lo is not None else near[hi]
    if not band.times.get(0):
        return 1.0
    excess = (statistics.median(band.times[0]) - 1.0) * p.modelled[0]
    return 1.0 + excess / max(p.modelled[k], 1e-12)


def nearby(bands: dict, drafter: str, index: int, k_max: int, reach: int = 2,
           need: int = 2) -> dict[int, float]:
    """k -> the median time ratio of arm k in the nearest other band of
    ``drafter``, at most ``reach`` bands away, that has at least ``need`` samples of it (one sample can be a
    step that paid a prefill or a catch-up; ``bands``: (drafter, band index) -> :class:`Band`); at equal
    distance the larger batch, where speculation pays less."""
    out = {}
    for k in range(k_max + 1):
        best = None
        for (d, i), band in bands.items():
            if d != drafter or i == index or abs(i - index) > reach or len(band.times.get(k, ())) < need:
                continue
            rank = (abs(i - index), -i)
            if best is None or rank < best[0]:
                best = (rank, band)
        if best is not None:
            out[k] = statistics.median(best[1].times[k])
    return out


def affordable(band: Band, budget: float, every: int) -> bool:
    """Whether the plain ``band`` may start a scheduled probe: its exploring so far within its share of its
    observed wall time.  The share is ``budget`` while the band probes every ``every`` plans, and shrinks in step
    as its interval backs off (every neighbour tried and lost): at 32 rows a band that never speculates would
    otherwise pay the whole budget for good."""
    return band.probe_seconds <= budget * every / max(band.interval, every, 1) * band.seconds


def choose(band: Band, p: Pending, prior_samples: int, margin: float) -> int:
    """The best k by estimate among k = 0 and the k > 0 measured here or nearby (every k while none is)."""
    est = [estimate(band, p, k, prior_samples) for k in range(len(p.modelled))]
    measured = [k for k in range(1, len(est)) if band.times.get(k) or k in p.prior]
    arms = measured if measured else range(1, len(est))
    if not arms:
        return 0
    best = max(arms, key=lambda k: (est[k], -k))                   # ties: the smaller k
    if band.best in arms and est[best] <= est[band.best] * (1.0 + margin / 2):
        best = band.best                                            # hysteresis between draft lengths
    return best if est[best] > est[0] * (1.0 + margin) * (1.0 + 1e-9) else 0


def neighbours(best: int, k_max: int) -> list[int]:
    """Probe order around the best: one up, one down, plain decoding, and the longest draft -- goodput need
    not be concave in k (a draft-side round trip is paid once per step, whatever k: k = 1 can lose to k = 0
    while k = 4 wins), so a walk over neighbours alone can stall at k = 0."""
    out = [k for k in (best + 1, best - 1, 0, k_max) if 0 <= k <= k_max and k != best]
    return list(dict.fromkeys(out)) or [best]


def prefill_share(p: Pending, per_row: float) -> float:
    """The drafter prefill a drafting step owes, ``per_row`` seconds per request spread over the request's tokens:
    each row's share is the fraction of its ``max_new_tokens`` this step committed.  In steady state that sums to
    what the arm pays for the requests that join it; charged where paid, a probe on fresh requests paid a whole
    prefill in three steps, and a band that decodes plainly saw every probe as slow as plain decoding."""
    if p.k == 0:
        return 0.0
    return per_row * sum((s.ctx.stats.generated_tokens - n) / max(getattr(s.req, "max_new_tokens", 0) or 1, 1)
                         for s, n in p.rows)
