"""Where a draft call goes (issue 32 item 1): the per-step draft call's hops in a real separated unit on the
config's family, per draft channel (``cluster.draft_channel``), and a ``speculator`` unit (near drafter, far
speculator: its speculation cache's columns, :func:`cluster.bench.report.cache_columns`), against the same step
in-process, and the same cache in-process with every answer in time (``speculator/in-time``: the hit shares a
speculator with a core of its own would get).

For each row (``default``, ``mag``, ``cs_drafting``: :func:`cluster.bench.served.row_specs`), greedy, c = 1, the
held-out prompts one after another, interleaved prompt by prompt over the runtimes (in-process, then one
:class:`cluster.serving.control.coordinator.Coordinator` per channel, ``separated``).  Per draft call
(``draft_batch``; :class:`cluster.serving.control.remote.CallTiming`): the round trip, the request's hop (sent ->
the actor's entry), the actor's time (entry -> exit) split into waiting for its own pre-draft and compute, the
reply's hop (exit -> received), the time beyond the actor's compute, the share of calls that used a pre-drafted
block and the compute of those calls vs the others.  Stamps are ``time.monotonic`` (CLOCK_MONOTONIC: one clock
for every process of the host); ``disordered`` counts calls whose stamps were not ordered sent <= entry <= exit
<= received (0 when the clocks agree).  In-process the draft call is timed in place (no hops).
"""
from __future__ import annotations

import dataclasses
import time

from cluster.bench.report import HOP_COLUMNS, hop_columns
from cluster.bench.served import parse_choices, row_specs, servable
from cluster.bench.served_cells import greedy_request
from cluster.config.layout import DRAFT_CHANNELS
from cluster.core.draft.programs import DRAFTS
from cluster.family.corpus import heldout_prompts
from cluster.local import build_engine
from cluster.serving.control.coordinator import Coordinator
from cluster.serving.control.remote import CallTiming

ROWS = ("default", "mag", "cs_drafting")
class _Timed:
    """The in-process draft side's ``draft_batch`` timed in place (an instance attribute over the method)."""

    def __init__(self, side):
        self.side, self.inner, self.timing = side, side.draft_batch, CallTiming()
        side.draft_batch = self

    def __call__(self, items):
        t0 = time.monotonic()
        try:
            return self.inner(items)
        finally:
            t1 = time.monotonic()
            self.timing.calls += 1
            self.timing.wall_s += t1 - t0
            self.timing.compute_s += t1 - t0

    def take(self) -> dict:
        out, self.timing = dataclasses.asdict(self.timing), CallTiming()
        return out

    def restore(self) -> None:
        del self.side.draft_batch


IN_TIME = "speculator/in-time"


def _taken(cache) -> dict:
    """The cache's counters since the last call (which resets them)."""
    out = cache.counters.as_dict()
    cache.counters = type(cache.counters)()
    return out


def _flat(t: dict | None) -> dict | None:
    """A speculator unit's draft timing is its cache's counters (``{"cache": {...}}``): those, to be added up."""
    return t["cache"] if t and "cache" in t else t


def _add(into: dict, t: dict | None) -> None:
    for k, v in (t or {}).items():
        into[k] = into.get(k, 0) + v


def unit_hops(args, cfg) -> list[dict]:
    """The table (see the module docstring); ``args.channels`` picks the channels (default all)."""
    n = int(args.prompts)
    max_new = int(args.max_new_tokens)
    channels = parse_choices("channels", getattr(args, "channels", None) or ",".join(DRAFT_CHANNELS), DRAFT_CHANNELS)
    engine = build_engine(cfg)
    prompts = [p["prompt_ids"] for p in heldout_prompts(engine.tokenizer, n)]
    specs = row_specs(cfg)
    rows = servable(engine, specs, list(ROWS))
    coords = {}
    timed = _Timed(engine.models[DRAFTS])
    try:
        for ch in channels:
            coords[f"separated/{ch}"] = Coordinator(dataclasses.replace(cfg, cluster=dataclasses.replace(
                cfg.cluster, topology="separated", draft_channel=ch)), topology="separated")
        if getattr(args, "speculator", True):
            coords["speculator"] = Coordinator(dataclasses.replace(cfg, cluster=dataclasses.replace(
                cfg.cluster, topology="speculator")), topology="speculator")
        runs = {"in-process": engine.generate, **{rt: c.generate_blocking for rt, c in coords.items()}}
        draft_of = {"in-process": timed.take, **{rt: (lambda c=c: _flat(c.draft_timing(reset=True)))
                                                  for rt, c in coords.items()}}
        if "speculator" in coords:                   # the same cache when every answer is in time
            ideal = build_engine(cfg, speculator=True)   # the speculator in this process, never late
            runs[IN_TIME], draft_of[IN_TIME] = ideal.generate, lambda: _taken(ideal.models[DRAFTS].cache)
        agg = {(r, rt): {"tokens": 0, "seconds": 0.0, "forwards": 0, "mismatches": 0, "t": {}} for r in rows
               for rt in runs}
        for i, ids in enumerate(prompts[:1] + prompts):          # the first prompt once more, untimed: warm-up
            ref = engine.generate(greedy_request(ids, max_new, "autoregressive", {}, i)).token_ids if i else None
            for r in rows:
                strategy, opts = specs[r]
                for rt, run in runs.items():
                    draft_of[rt]()
                    t0 = time.perf_counter()
                    res = run(greedy_request(ids, max_new if i else 4, strategy, opts, i))
                    wall = time.perf_counter() - t0
                    t = draft_of[rt]()
                    if not i:
                        continue
                    a = agg[(r, rt)]
                    a["tokens"] += len(res.token_ids)
                    a["seconds"] += wall
                    a["forwards"] += res.stats.target_forwards
                    a["mismatches"] += res.token_ids != ref
                    _add(a["t"], t)
    finally:
        timed.restore()
        for c in coords.values():
            c.shutdown()
    out = []
    for r in rows:
        for rt in runs:
            a = agg[(r, rt)]
            cols = hop_columns({"cache": a["t"]} if rt.startswith("speculator") else a["t"])
            if rt == "in-process":          # no hops: the step's drafting, timed in place
                cols = {k: cols.get(k) if k in ("draft_calls", "draft_ms", "compute_ms") else None for k in HOP_COLUMNS}
            timed_here = rt != IN_TIME              # (there the speculator drafts inside the step: no speed)
            out.append({"strategy": r, "runtime": rt,
                        "tok_s": round(a["tokens"] / a["seconds"], 1) if timed_here else None,
                        "step_ms": round(1e3 * a["seconds"] / max(1, a["forwards"]), 3) if timed_here else None,
                        **cols, "mismatches": a["mismatches"]})
    return out
