"""The simulator's inputs for THIS machine, measured in-process (:mod:`cluster.bench.simulate`).

* forward costs (each cell the fastest of :data:`REPEATS` passes): the engine's own handles timed by
  :func:`cluster.engine.measure.measure_costs` (the target by rows x (1, k + 1) tokens, the drafter by rows
  x 1) and the prompts' prefill by :func:`cluster.engine.measure.forward_cost_grid` at the held-out prompts'
  mean length;
* the machine's speed: against a served run, every cost is scaled by how much slower the in-process
  autoregressive cell beside each topology's cells ran than this suite's (:meth:`Inputs.at_speed`);
* acceptance: a short greedy run of each strategy, alone and batched, whose per-step accepted counts
  (``RequestStats.accepted_hist``) the simulator replays, and whose accepted / drafted share is the bonus-guess
  rate;
* the engine's own work per step (``overhead(rows)``): that run's wall seconds per step less the forwards the
  cost tables price, at one row (alone) and at the mean rows of batched runs of :data:`BATCHES` requests,
  piecewise linear between them (and beyond the last, along the last segment);
* the draft call beyond the actor's compute (``rtt``), per ``cluster.draft_channel``: a Ray call from
  docs/cluster.md's "Where a served step goes now" (2.20 ms neural, 1.60 ms mag), the socket from "The draft
  call's hops, per channel" (0.52 / 0.35 ms); and the draft side's own work per block beyond its k drafter
  forwards, that table's 3.68 ms of compute for a k = 4 call at one row less k forwards priced now -- both
  replaced, cell by cell, by the served run's own hops where its table has them (separated cells);
* the served step's own work, ``a`` seconds per step plus ``b`` per token it emitted (handing tokens to the
  front, waking waiters): the fitted parameters, ``a + b`` from the measured autoregressive served cell at c = 1
  of each topology and ``b`` from its cell at the largest c (:func:`fit_served`).  It was a per-request front
  cost, fitted at c = 1 alone: a request of autoregressive decoding's 64 steps then carried 67-89 ms of "front"
  that a speculative request of 17 steps carried as well, and as a server it capped autoregressive at 718 tok/s
  from c = 16 (measured: 1,060-1,234).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from cluster.bench.simulate import Strategy, Unit, replicate
from cluster.config.layout import split_label
from cluster.core.draft.cache import FanOut
from cluster.core.draft.near_far import NearFarSide
from cluster.core.draft.programs import DRAFTS
from cluster.core.forward_cost import ForwardCost
from cluster.core.sampling import SamplingParams
from cluster.engine.measure import forward_cost_grid, measure_costs
from cluster.engine.request import GenerationRequest
from cluster.strategies import REGISTRY, resolve_options

# the separated draft call beyond the actor's compute, per cluster.draft_channel (docs/cluster.md: a Ray call,
# "Where a served step goes now"; a socket, "The draft call's hops, per channel", beyond compute)
RTT_S = {"ray": {"neural": 2.20e-3, "mag": 1.60e-3}, "socket": {"neural": 0.52e-3, "mag": 0.35e-3}}
SOCKET_RTT_S = 0.46e-3         # a fill and its answer over a socket: 0.26 + 0.20 ms (ibid., "The draft call's hops")
ACTOR_DRAFT_S = 3.68e-3                             # ibid.: a k = 4 draft call's compute in the actor, one row
ROWS = (1, 2, 4, 8, 16)
REPEATS = 3                                          # passes per run; the fastest is kept
BATCHES = (16, 32)                                   # requests run together for the per-step overhead's points
K = 4
BRANCHES = 2         # the speculator's branches per row and fill: served at c = 1 its fan-out held 1.3-1.7


@dataclass
class Measured:
    """One strategy's in-process run: replayable acceptance and the engine's work per step."""

    name: str
    strategy: str | None
    options: dict
    k: int = 0
    drafter: str | None = None                       # a neural drafter's name; None: none or free
    draft: str | None = None                         # what drafts (:func:`draft_kind`): neural, free or cascade
    accepted: tuple[float, ...] | None = None
    alpha: float = 0.0
    overhead: tuple[tuple[float, float], ...] = ()  # (rows, seconds) points
    step_ms: dict = field(default_factory=dict)      # rows -> measured ms per step in-process
    cache_hits: float | None = None                  # the speculation cache's share of steps, every answer in time
    alone_tok_s: float = 0.0                         # one request at a time, prefill included

    def overhead_at(self, rows: float) -> float:
        pts = sorted(self.overhead)
        if len(pts) == 1:
            return max(0.0, pts[0][1])
        i = next((j for j in range(1, len(pts) - 1) if rows <= pts[j][0]), len(pts) - 1)
        (r0, o0), (r1, o1) = pts[i - 1], pts[i]
        return max(0.0, o0 if r1 == r0 else o0 + (o1 - o0) * (rows - r0) / (r1 - r0))


@dataclass
class Inputs:
    target: ForwardCost
    prefill: ForwardCost
    drafters: dict                                   # name -> (ForwardCost per token, prefill ForwardCost)
    strategies: list[Measured]
    prompt_len: int
    max_batch: int
    plain_from: int | None = None                    # the config's engine.plain_from_batch (measured without it)
    speed: float = 1.0                               # every in-process cost x this (:meth:`at_speed`)
    channel: str = "ray"                             # the separated draft call's (cluster.draft_channel)

    def at_speed(self, then_tok_s: float | None) -> None:
        """Scale every cost to the machine's speed during a served run whose own in-process autoregressive cell
        read ``then_tok_s`` (the same prompts, one at a time): a slower machine then made every forward of that
        run dearer, which the served step fitted on autoregressive would otherwise absorb as served work."""
        ar = next((m for m in self.strategies if m.k == 0 and m.alone_tok_s), None)
        self.speed = ar.alone_tok_s / then_tok_s if ar and then_tok_s else 1.0

    def drafted_far(self, m: Measured) -> bool:
        """Whether the speculator topology drafts ``m``'s blocks far: a neural drafter's, not a cascade's (as
        :meth:`cluster.core.draft.near_far.NearFarSide._worth` decides)."""
        return m.k > 0 and m.draft == "neural" and m.drafter in self.drafters

    def unit(self, served: tuple[float, float] = (0.0, 0.0), topology: str = "colocated") -> Unit:
        """This machine's unit: two cores, the coordinator's and one that Serve's proxy, its replica and the
        clients share -- with the draft actor in the separated topology, the speculator in its own; ``served``:
        (a, b) of the served step's own work, ``a`` seconds per step and ``b`` per token emitted (:func:`fit_served`)."""
        x = self.speed
        return Unit(_scaled(self.target, x), prefill=lambda r: x * self.prefill(r, self.prompt_len),
                    max_batch=self.max_batch,
                    shared_core=split_label(topology)[0] in ("separated", "speculator"),
                    served_step=served[0], served_token=served[1])

    def strategy(self, m: Measured, topology: str, call: tuple[float, float] | None = None, rows: int = 1) -> Strategy:
        """``m`` as served in ``topology``: separated drafts through one call per step (pre-drafting with a
        neural drafter, as ``engine.overlap: auto`` does there); colocated drafts in-process; speculator drafts
        a neural drafter's misses in-process beside the speculator's fills (``Strategy.speculator``), the rest as
        colocated; fixed-k rows decode plainly from ``plain_from`` rows up.  ``call``: the separated draft call as
        the served run measured it hop by hop at ``rows`` clients (seconds of the actor's compute on a miss, and
        beyond its compute), in place of the cited one-row figures: the actor's own work grows with the rows."""
        cost, pre = (_scaled(f, self.speed) for f in self.drafters.get(m.drafter, (None, None)))
        topology, channel = split_label(topology)              # the served suite's "separated+ray" labels
        sep = topology == "separated" and m.k > 0
        far = topology == "speculator" and self.drafted_far(m)
        side_work = max(0.0, ACTOR_DRAFT_S - m.k * cost(1, 1)) if sep and cost else 0.0
        rtt = RTT_S[channel or self.channel]["neural" if cost else "mag"] if sep else SOCKET_RTT_S if far else 0.0
        if sep and call is not None:     # a cascade's drafting is most of the engine's measured work (5.6 ms a step
            own = call[0] if m.draft == "free" else 0.0      # in-process; Max-Gram's 0.24 ms): the actor's replaces it
            side_work, rtt = max(0.0, call[0] - m.k * cost(rows, 1)) if cost else own, call[1]
        return Strategy(m.name, k=m.k, drafter=cost, side_work=side_work,
                        draft_prefill=(lambda r: pre(r, self.prompt_len)) if pre else None, alpha=m.alpha,
                        accepted=m.accepted, separated=sep, speculator=far, hit_rate=m.cache_hits if far else None,
                        branches=BRANCHES,
                        rtt=rtt,
                        predraft=sep and cost is not None,
                        predraft_rows=NearFarSide.MAX_ROWS if far else Strategy.predraft_rows,
                        overhead=_scaled(m.overhead_at, self.speed),
                        plain_from=self.plain_from if m.k and m.options.get("plan", "fixed") == "fixed" else None,
                        plain_overhead=next((_scaled(a.overhead_at, self.speed) for a in self.strategies if a.k == 0),
                                            None))


def _scaled(f, x: float):
    """``f`` with its seconds times ``x`` (None stays None)."""
    return f if f is None or x == 1.0 else lambda *args: x * f(*args)


def _forwards(inp_target, drafter, k: int, rows: float) -> float:
    return (k * drafter(rows, 1) if drafter is not None and k else 0.0) + inp_target(rows, k + 1)


def _run(engine, m: Measured, prompts, max_new: int, batched: bool):
    reqs = [GenerationRequest(prompt_ids=list(p), max_new_tokens=max_new, sampling=SamplingParams(0.0), seed=0,
                              strategy=m.strategy, options=dict(m.options), ignore_eos=True) for p in prompts]
    t0 = time.perf_counter()
    out = engine.generate_many(reqs) if batched else [engine.generate(r) for r in reqs]
    return out, time.perf_counter() - t0


def measure_strategy(engine, inp: Inputs, m: Measured, prompts, max_new: int, batches: tuple[int, ...]) -> Measured:
    """Run ``m`` greedy on ``prompts`` one at a time, then each of ``batches`` of them (cycled) together, each
    :data:`REPEATS` times keeping the fastest pass; fill its acceptance
    histogram, bonus rate and per-step overhead (wall per step less the priced forwards)."""
    drafter = inp.drafters.get(m.drafter, (None, None))[0]
    engine.generate(GenerationRequest(prompt_ids=list(prompts[0]), max_new_tokens=4, sampling=SamplingParams(0.0),
                                      seed=0, strategy=m.strategy, options=dict(m.options), ignore_eos=True))
    hist, drafted, accepted, walls = [0] * (m.k + 1), 0, 0, []
    runs_of = [(False, prompts)] + [(True, (list(prompts) * b)[:b]) for b in batches]
    for batched, group in runs_of:
        runs = [_run(engine, m, group, max_new, batched) for _ in range(REPEATS)]
        out, wall = min(runs, key=lambda run: run[1])         # the least disturbed pass on a shared machine
        # every step after the prompt's forward, plain ones too (``stats.steps`` counts only those that drafted: the
        # planner's k = 0, plain_from_batch and a last one-token step left them out, and 16 plain rows read 0.7 s a
        # step); autoregressive's prompt forward emits its first token, as the simulation's first step does
        steps = [max(1, r.stats.target_forwards - (1 if m.k else 0)) for r in out]
        for r in out:
            hist += [0] * (len(r.stats.accepted_hist) - len(hist))
            for n, count in enumerate(r.stats.accepted_hist):
                hist[n] += count
            drafted, accepted = drafted + r.stats.drafted_tokens, accepted + r.stats.accepted_tokens
        if batched:
            n_steps = max(steps)
            rows = sum(steps) / n_steps
            wall -= inp.prefill(len(group), inp.prompt_len)
        else:
            n_steps, rows = sum(steps), 1.0
            m.alone_tok_s = sum(len(r.token_ids) for r in out) / wall
            wall -= len(group) * inp.prefill(1, inp.prompt_len)
        per_step = wall / n_steps
        m.step_ms[round(rows, 1)] = round(1e3 * per_step, 3)
        walls.append((rows, per_step))
    if m.k:              # a cascade drafts blocks longer than its k (CS Drafting's vertical cascade): its longest
        m.k = len(hist) - 1                              # block is what a step verifies at most
    m.overhead = tuple((rows, per_step - _forwards(inp.target, drafter, m.k, rows)) for rows, per_step in walls)
    if m.k:
        # none: every step of the runs decoded plainly (a planned row whose planner chose k = 0 throughout)
        m.accepted = tuple(h / sum(hist) for h in hist) if sum(hist) else None
        m.alpha = accepted / drafted if drafted else 0.0
    return m


def measure_cache(far, m: Measured, prompts, max_new: int) -> Measured:
    """``m.cache_hits``: the share of steps the speculation cache served, ``m`` run greedy on ``prompts`` one at a
    time through ``far`` (an in-process engine over the speculator topology's near-far side whose speculator answers
    every fill before the next step: :func:`cluster.local.build_engine` with ``speculator=True``).  The served
    cache serves fewer: some answers come late (the simulation has them come when the core it shares is free).
    :data:`BRANCHES` branches per fill, as the simulation prices a fill (the served fan-out adapts; 0.47 of steps
    hit here with one branch, 0.62 with two, 0.80 with the whole fan-out).  Hits taken at a step's start only: here
    the block a miss step sends before near drafts (``then``) is drafted at once and always wins the race
    (:mod:`cluster.core.draft.race`); served, only when near is slower."""
    side = far.models[DRAFTS]
    c, fanout, side.fanout = side.counters, side.fanout, FanOut(rows=BRANCHES, min_rows=BRANCHES, max_rows=BRANCHES)
    hits, steps = sum(c.hits.values()) - c.raced, c.steps
    try:
        _run(far, m, prompts, max_new, False)
    finally:
        side.fanout = fanout
    m.cache_hits = (sum(c.hits.values()) - c.raced - hits) / max(1, c.steps - steps)
    return m


def measure_inputs(engine, cfg, prompts, max_new: int, specs: dict[str, tuple], batches=BATCHES,
                   far=None) -> Inputs:
    """Everything the simulator needs about this machine, measured now through ``engine`` (and ``far``: the
    speculation cache's hits, :func:`measure_cache`, for the rows the speculator topology drafts far)."""
    neural = sorted({o.get("drafter") for _, (s, o) in specs.items() if o.get("drafter")})
    passes = [measure_costs(engine.models, cfg.target, neural, rows=ROWS, new_tokens=(1, K + 1), iters=3)
              for _ in range(REPEATS)]
    costs = {n: _fastest([p[n] for p in passes]) for n in passes[0]}
    plen = round(sum(map(len, prompts)) / len(prompts))
    pre = {n: _fastest([ForwardCost(forward_cost_grid(engine.models[n], rows=(1, 4, 16), new_tokens=(plen,),
                                                      context=1, iters=2)) for _ in range(REPEATS)])
           for n in [cfg.target, *neural]}
    inp = Inputs(costs[cfg.target], pre[cfg.target], {n: (costs[n], pre[n]) for n in neural}, [], plen,
                 cfg.engine.max_batch, cfg.engine.plain_from_batch, channel=cfg.cluster.draft_channel)
    sizes = tuple(sorted({min(b, cfg.engine.max_batch) for b in batches}))
    for name, (strategy, opts) in specs.items():
        k = int(opts.get("k", K)) if strategy != "autoregressive" else 0
        m = Measured(name, strategy, opts, k=k, drafter=opts.get("drafter") if k else None,
                     draft=draft_kind(engine, cfg.target, strategy, opts) if k else None)
        inp.strategies.append(measure_strategy(engine, inp, m, prompts, max_new, sizes))
        if far is not None and inp.drafted_far(m):
            measure_cache(far, m, prompts, max_new)
    return inp


def draft_kind(engine, target: str, strategy: str, opts: dict) -> str | None:
    """What drafts for ``strategy``: ``cascade`` (CS Drafting's program), ``free`` (deterministic drafters only: the
    Max-Gram drafter), ``neural``, or None (no draft program), read from the strategy's own draft spec."""
    spec = getattr(REGISTRY[strategy](resolve_options(strategy, opts, {}), engine.models, target), "spec", None)
    if spec is None:
        return None
    if spec.kind == "cascade":
        return "cascade"
    return "free" if all(getattr(engine.models.get(n), "deterministic", False) for n in spec.drafters) else "neural"


def _fastest(tables: list[ForwardCost]) -> ForwardCost:
    """Cell by cell the fastest of several measured passes (a shared machine only ever slows a pass down),
    made monotone."""
    return ForwardCost({key: min(t.table[key] for t in tables) for key in tables[0].table}).monotone()


def fit_served(inp: Inputs, ar_cells: dict[int, dict], max_new: int, topology: str) -> tuple[float, float]:
    """(a, b): the served step's own work, ``a`` seconds per step and ``b`` per token emitted, that makes the
    simulated autoregressive cells read what was measured -- at c = 1 (one token a step) ``a + b`` is the
    measured seconds per request less the simulated ones, per step; ``b`` (0 without a cell above c = 1) by
    bisection on the cell at the largest c.  ``ar_cells``: c -> the measured autoregressive cell (``tok_s``,
    ``requests``)."""
    ar = next(m for m in inp.strategies if m.k == 0)
    strategy = inp.strategy(ar, topology)
    one = ar_cells[1]
    bare = replicate(inp.unit((0.0, 0.0), topology), strategy, 1, one["requests"], max_new, seeds=1)
    per_request = bare.steps / max(bare.requests, 1)
    step = max(0.0, (max_new / one["tok_s"] - bare.seconds / one["requests"]) / per_request)
    c = max(ar_cells)
    if c == 1:
        return step, 0.0
    lo, hi = 0.0, step                                   # b: seconds per token, within a + b at one client
    for _ in range(30):                                  # simulated tok/s falls as b grows (and a shrinks)
        mid = (lo + hi) / 2
        res = replicate(inp.unit((step - mid, mid), topology), strategy, c, ar_cells[c]["requests"], max_new,
                        seeds=1)
        lo, hi = (mid, hi) if res.tok_s > ar_cells[c]["tok_s"] else (lo, mid)
    b = (lo + hi) / 2
    return step - b, b
