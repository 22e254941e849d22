"""``specserve bench --cluster``: every strategy through the cluster vs in-process, one run.

Runtimes (same weights, same held-out prompts, interleaved prompt by prompt):
  * ``in-process`` -- :func:`cluster.local.build_engine`;
  * ``cluster/separated`` -- the coordinator's engine, the drafters behind the draft side in their own actor;
  * ``cluster/colocated`` -- the same engine, the drafters in the coordinator's process.
Actors are reached with plain Ray actor calls (:mod:`actors.protocol`); the target sits where the config puts it.
The cluster rows run the coordinator's engine in this process (the per-step path a Serve replica
runs; a request's gRPC/HTTP hop is paid once per request, not per step).  Columns: tokens/s and
its ratio to in-process; per decoding step (= target call): wall ms, the share spent in actor
compute, in RPC overhead (round trip minus actor compute), and in the coordinator (local drafters,
verification, Python).  Torch uses the same thread count in-process as in each actor.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from cluster.bench.report import print_table, write_results
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError, check_float, check_int
from cluster.family.corpus import heldout_prompts
from cluster.local import build_engine
from cluster.serving.control.coordinator import Coordinator
from cluster.strategies import REGISTRY

LAYOUTS = ("separated", "colocated")


def run(args, cfg) -> int:
    import ray

    n = check_int("prompts", args.prompts, 1, 256)
    max_new = check_int("max_new_tokens", args.max_new_tokens, 1, cfg.engine.max_new_tokens_limit)
    temperature = check_float("temperature", args.temperature, 0.0, 100.0)
    threads = cfg.cluster.target.threads
    torch.set_num_threads(threads)
    engine = build_engine(cfg)
    prompts = [p["prompt_ids"] for p in heldout_prompts(engine.tokenizer, n)]
    strategies = _servable(engine, prompts[0])
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, namespace="specserve-bench")
    coords = {}
    try:
        t0 = time.perf_counter()
        for topo in LAYOUTS:
            coords[topo] = Coordinator(cfg, topology=topo)
        print(f"[cluster up: {time.perf_counter() - t0:.1f}s; strategies: {', '.join(strategies)}; "
              f"torch threads {threads}]")
        runtimes = {"in-process": engine.generate,
                    **{f"cluster/{t}": c.generate_blocking for t, c in coords.items()}}
        agg = {(s, r): _Agg() for s in strategies for r in runtimes}
        for s in strategies:                     # warm-up: one short request per strategy and runtime
            for run in runtimes.values():
                run(_req(prompts[0], 4, temperature, s, 0))
        for c in coords.values():
            c.reset_timings()
        for i, ids in enumerate(prompts):
            for s in strategies:
                ref = None
                for rname, run in runtimes.items():
                    coord = coords.get(rname.split("/")[-1]) if rname != "in-process" else None
                    before = _timing_totals(coord)
                    t = time.perf_counter()
                    res = run(_req(ids, max_new, temperature, s, i))
                    wall = time.perf_counter() - t
                    after = _timing_totals(coord)
                    a = agg[(s, rname)]
                    a.add(res, wall, [x - y for x, y in zip(after, before)])
                    if ref is None:
                        ref = res.token_ids
                    elif res.token_ids != ref:
                        a.mismatches += 1
        rows = []
        for s in strategies:
            base = agg[(s, "in-process")]
            for rname in runtimes:
                rows.append(agg[(s, rname)].row(s, rname, base))
    finally:
        for c in coords.values():
            c.shutdown()
        if started:
            ray.shutdown()
    title = f"cluster vs in-process: {cfg.source}, {n} prompts x {max_new} tokens, temperature {temperature}"
    print_table(rows, title)
    write_results(rows, Path(args.out), "cluster")
    bad = [r for r in rows if r["mismatches"]]
    if bad and temperature == 0:
        print(f"WARNING: {len(bad)} rows differ from in-process output")
    return 0


def _servable(engine, ids) -> list[str]:
    out = []
    for s in REGISTRY:
        try:
            engine.prepare(_req(ids, 1, 0.0, s, 0))
            out.append(s)
        except ParamError:
            pass
    return out


def _req(ids, max_new, temperature, strategy, seed) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(ids), max_new_tokens=max_new, sampling=SamplingParams(temperature),
                             seed=seed, strategy=strategy)


def _timing_totals(coord) -> tuple[float, float, int]:
    """(caller-side round-trip seconds, actor compute seconds, calls) over the unit's remote models."""
    if coord is None:
        return 0.0, 0.0, 0
    ts = coord.timings().values()
    return sum(t.wall_s for t in ts), sum(t.compute_s for t in ts), sum(t.calls for t in ts)


class _Agg:
    def __init__(self):
        self.tokens = self.target_calls = self.calls = self.mismatches = 0
        self.seconds = self.rpc_wall = self.compute = 0.0
        self.accepted = self.steps = 0

    def add(self, res, wall, timing) -> None:
        st = res.stats
        self.tokens += len(res.token_ids)
        self.seconds += wall
        self.target_calls += st.target_forwards
        self.accepted += st.accepted_tokens
        self.steps += st.steps
        self.rpc_wall += timing[0]
        self.compute += timing[1]
        self.calls += timing[2]

    def row(self, strategy, runtime, base: "_Agg") -> dict:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        base_tps = base.tokens / base.seconds if base.seconds else 0.0
        per = 1000.0 / max(1, self.target_calls)
        local = self.seconds - self.rpc_wall if runtime != "in-process" else self.seconds
        return dict(strategy=strategy, runtime=runtime, tokens=self.tokens, seconds=round(self.seconds, 3),
                    tokens_per_s=round(tps, 1), vs_in_process=round(tps / base_tps, 3) if base_tps else None,
                    step_ms=round(self.seconds * per, 3),
                    actor_compute_ms=round(self.compute * per, 3),
                    rpc_overhead_ms=round(max(0.0, self.rpc_wall - self.compute) * per, 3),
                    coordinator_ms=round(local * per, 3),
                    rpcs_per_step=round(self.calls / max(1, self.target_calls), 2),
                    accepted_per_step=round(self.accepted / self.steps, 2) if self.steps else 0.0,
                    mismatches=self.mismatches)
