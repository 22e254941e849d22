"""Forward costs measured through the handles an engine really uses, and the one place that builds its planner.

Both composition roots (:mod:`cluster.local` in-process, :mod:`cluster.serving.control.coordinator` on Ray) call
:func:`build_planner` with the handles they give the engine, so the load-aware planner's prior is priced
from what a step really pays: in-process forwards there, forwards plus actor round trips (and the queued
rollbacks each call carries) through :class:`cluster.serving.control.remote.RemoteHandle`.  Only the handle
protocol is used (:class:`cluster.core.interfaces.BatchedHandle`: ``prefill_batch`` / ``score_batch`` /
``rollback`` / ``release``), so this module imports no model code.
"""
from __future__ import annotations

import random
import time
from functools import partial
from typing import Mapping

from cluster.core.calls import Draft, PrefillItem, Score, run_group
from cluster.core.forward_cost import ForwardCost
from cluster.core.draft.programs import DRAFTS, DraftSpec
from cluster.core.sampling import SamplingParams
from cluster.engine.planner import Planner

ROWS = (1, 2, 4, 8, 16, 32)        # batch sizes measured (capped by the engine's max_batch, at most 32)
NEW_TOKENS = (1, 2, 3, 5, 9)       # tokens fed per row by the target's forward: k + 1 for k = 0, 1, 2, 4, 8


def _fastest_cells(handle, kind: type, rows, variants, make_call, context: int, iters: int,
                   prefix: str) -> dict[tuple[int, object], float]:
    """The fastest of ``iters`` wall-second timings of one batched ``kind`` call through ``handle`` per (row
    count r, variant v) -- the minimum, not the median: on a machine shared with other work a timing is the
    call's cost plus whatever interfered, and the planner needs the tables' shape across rows and tokens (its
    measured step times scale them), which a few interrupted timings bend:
    r requests (ids ``<prefix><i>``) with ``context`` random cached tokens each get ``make_call(v)``; one
    warm-up call per cell, every request rolled back to its context after each call and released at the end."""
    gen = random.Random(0)
    result = {}
    for r in rows:
        rids = [f"{prefix}{i}" for i in range(r)]
        handle.prefill_batch([PrefillItem(rid, [gen.randrange(handle.vocab_size) for _ in range(context)],
                                          SamplingParams(), i) for i, rid in enumerate(rids)])
        try:
            for v in variants:
                calls = [(rid, make_call(v)) for rid in rids]
                times = []
                for it in range(iters + 1):                  # one warm-up
                    t0 = time.perf_counter()
                    run_group(handle, kind, calls)           # one batched call (or per request)
                    if it:
                        times.append(time.perf_counter() - t0)
                    for rid in rids:
                        handle.rollback(rid, context)
                result[(r, v)] = min(times)
        finally:
            for rid in rids:
                handle.release(rid)
    return result


def forward_cost_grid(handle, rows=(1, 4, 8, 16, 32), new_tokens=(1, 5), context: int = 128,
                      iters: int = 10) -> dict[tuple[int, int], float]:
    """Wall seconds (the fastest of ``iters``) of one batched score forward through ``handle``: ``rows``
    requests with ``context`` cached tokens, each feeding ``new_tokens`` tokens (the last context token plus a draft of new_tokens - 1).
    One warm-up call per cell; the measuring requests (ids ``__grid<i>``) are released at the end."""
    return _fastest_cells(handle, Score, rows, new_tokens, lambda t: Score(handle.name, (1,) * (t - 1)),
                         context, iters, "__grid")


def draft_cost_grids(side, drafter: str, rows=(1, 4, 8, 16, 32), lengths=(1, 3), context: int = 64,
                     iters: int = 10) -> tuple[dict, dict]:
    """What a step's drafting costs through the draft side ``side`` (one call per step, however many tokens):
    per row count r, the fastest wall seconds D(r, k) of one ``Draft`` call of k tokens from ``drafter`` for r
    requests, at the two ``lengths`` k1 < k2, split into a per-token part f(r) = (D(r, k2) - D(r, k1)) /
    (k2 - k1) (one drafter forward) and a per-call part D(r, k1) - k1 f(r) (the round trip, packing, the
    program), both >= 0.  Returns ``({(r, 1): f(r)}, {(r, 1): call(r)})``; request ids ``__draft<i>``."""
    spec, (k1, k2) = DraftSpec("propose", (drafter,)), lengths
    d = _fastest_cells(side, Draft, rows, (k1, k2), lambda k: Draft(DRAFTS, spec, k, k + 1), context, iters,
                      "__draft")
    per_token, per_call = {}, {}
    for r in rows:
        f = max(0.0, (d[(r, k2)] - d[(r, k1)]) / (k2 - k1))
        per_token[(r, 1)], per_call[(r, 1)] = f, max(0.0, d[(r, k1)] - k1 * f)
    return per_token, per_call


def planner_rows(max_batch: int, rows=ROWS) -> tuple[int, ...]:
    """The measured batch sizes: ``rows`` up to ``min(max_batch, 32)``, which is always included."""
    cap = max(1, min(int(max_batch), 32))
    return tuple(sorted({r for r in rows if r <= cap} | {cap}))


def measure_costs(handles: Mapping[str, object], target: str, drafters, *, rows=ROWS, new_tokens=NEW_TOKENS,
                  context: int = 64, iters: int = 3) -> dict[str, ForwardCost]:
    """:class:`ForwardCost` tables measured now: the target over ``rows`` x ``new_tokens``, each neural drafter
    over ``rows`` x one token (the planner prices k drafter forwards of one token).  Deterministic drafters
    (the Max-Gram drafter, ``handle.deterministic``) get no table: they draft for free.

    Where the engine drafts through a draft side in another process (``handles[DRAFTS]``, the separated
    topology), a step pays ONE call for all its drafting, so the drafters' tables come from that call
    (:func:`draft_cost_grids`: per token) and ``costs[DRAFTS]`` holds the per-call part (the round trip),
    which the planner charges once per speculating step -- not once per drafted token, which priced k = 4
    at five round trips and made the prior start at k = 0."""
    costs = {}
    side = handles.get(DRAFTS)
    for name in dict.fromkeys([target, *drafters]):
        handle = handles.get(name)
        if handle is None or handle.deterministic:
            continue
        if side is not None and name != target:
            per_token, per_call = draft_cost_grids(side, name, rows=rows, iters=iters,
                                                   context=max(1, min(context, side.max_length - 8)))
            costs[name] = ForwardCost(per_token).monotone()
            costs.setdefault(DRAFTS, ForwardCost(per_call).monotone())
            continue
        feeds = new_tokens if name == target else (1,)
        grid = forward_cost_grid(handle, rows=rows, new_tokens=feeds,
                                 context=max(1, min(context, handle.max_length - max(feeds))), iters=iters)
        costs[name] = ForwardCost(grid).monotone()          # timing noise: never cheaper when larger
    return costs


def build_planner(handles: Mapping[str, object], target: str, drafters, spec, *, measure_now: bool | None = None,
                  iters: int = 3) -> Planner:
    """THE planner of an engine over ``handles`` (the ones the engine will use), for a config's ``engine:``
    section ``spec`` (read by attribute: ``max_batch``, ``options``).

    Every engine gets one: it acts only on requests whose strategy is load-aware (``plan=load_aware``), so a
    per-request ``plan=load_aware`` works whatever the config's default.  Its forward costs are measured now
    when ``measure_now`` is True, or (None) when the config's default options ask for the planner
    (``engine.options.plan: load_aware``); otherwise on the first step that plans (measuring then takes a few
    seconds, once), so an engine that never plans never measures."""
    if measure_now is None:
        measure_now = (getattr(spec, "options", None) or {}).get("plan") == "load_aware"
    measure = partial(measure_costs, dict(handles), target, list(drafters),
                      rows=planner_rows(getattr(spec, "max_batch", 32)), iters=iters)
    if measure_now:
        return Planner(measure(), target)
    return Planner(None, target, measure=measure)
