"""``specserve bench --suite served``: every strategy as a user meets it, through gRPC, vs concurrency,
unary and streamed side by side, in every topology (the separated one per draft channel with ``--channels``).

The suite starts its own cluster: a local Ray (unless the caller already started one) and the Serve
application of the config (:func:`cluster.serving.fronts.app.start_serve`) once per topology (``--topologies``,
default ``separated,colocated,speculator``: ``cluster.topology`` forced to each in turn) with the gRPC/HTTP proxies on free
127.0.0.1 ports; it waits for the health service to say SERVING and shuts Serve (and the Ray it started) down
at the end, on errors and Ctrl-C too.  All traffic goes to 127.0.0.1.

Rows (``--strategies``, default all the config can serve): ``autoregressive``; ``default`` (a request
naming no strategy: the config's ``engine.strategy`` with its ``engine.options``); ``speculative``
(drafter-large, or the config's default drafter, k=4); ``mag`` (Max-Gram drafter, its default k) and
``cs_drafting`` (default options).  At each
concurrency ``c`` (``--concurrency``, default 1,2,4,8,16,32, clamped to ``engine.max_batch + engine.max_queue``)
every row runs one cell per mode in turn (interleaved, so a noisy machine affects them alike): ``c`` client threads send
requests back to back, unary (``Generate``) or streaming (``GenerateStream``), ``--modes`` (default both),
over the held-out prompts: ``c * --requests-per-client`` requests per cell, or ``--requests-per-cell`` (at
least c), default ``max(2c, 8)``; greedy, ``--max-new-tokens`` each with ``ignore_eos`` so every request
generates the same number of tokens.  One untimed warm-up request per row and mode first.

Per cell: output tokens/s (generated tokens / wall time of the cell, first submit to last chunk), its
ratio to autoregressive at the same ``c`` and mode, streamed / unary of the same row, TTFT p50/p99 (streamed
only: submit -> first chunk with tokens), TPOT p50/p99
(per request: (end-to-end - TTFT) / (tokens - 1)), failures by gRPC status, and where the draft side has its
own actor the draft call's hops (:func:`cluster.bench.report.hop_columns`: round trip, request hop, the actor's
wait and compute, reply hop, pre-draft hit share; in the ``speculator`` topology the speculation cache's columns,
:func:`cluster.bench.report.cache_columns`: hit share by branch kind, late answers, wasted draft tokens, fan-out,
the coordinator's ms per all-hit draft call), read from the replica after each cell.  At ``c = 1`` each row also
runs in-process (:func:`cluster.local.build_engine`, ``engine.generate`` on the same prompts and token
counts), in every topology, for the ``cluster_vs_in_process`` column: request by request, each served request of
the first mode's cell followed by the same request in-process, and both cells' seconds the sum of their
requests' (this shared machine's speed drifts within a cell: blocks of requests moved the ratio 5-10 %).  Every greedy
output, served and in-process, is checked against autoregressive's for the same prompt; any mismatch is printed
and makes the exit code 1.  Prints the whole table and the side-by-side summary (one line per topology and ``c``);
writes ``bench_served.{csv,json,png}`` and ``bench_served_summary.{csv,json}`` to ``--out``.
"""
from __future__ import annotations

import dataclasses
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass

from tqdm import tqdm

from cluster.bench.load import parse_concurrency
from cluster.bench.served_cells import Cell, in_process, in_process_cell, pair_with, request_seconds, served_cell
from cluster.bench.report import local_ray
from cluster.bench.served_report import report
from cluster.config.layout import DRAFT_CHANNELS, split_label, topology_label
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError, check_float, check_int
from cluster.family.corpus import heldout_prompts
from cluster.local import build_engine
from cluster.serving.fronts.app import build_app, start_serve
from cluster.serving.client.sdk import SpecServeClient
from cluster.strategies.mag import K as MAG_K

ROWS = ("autoregressive", "default", "speculative", "mag", "cs_drafting")
MODES = ("unary", "streamed")
TOPOLOGIES = ("separated", "colocated", "speculator")
LEVELS = (1, 2, 4, 8, 16, 32)
K = 4                            # speculative rows (mag rows: the mag strategy's own default)
PREFERRED_DRAFTER = "drafter-large"
WARMUP_TOKENS = 4
REQUEST_TIMEOUT_S = 300.0        # one gRPC request; a stuck server fails it as DEADLINE_EXCEEDED
READY_TIMEOUT_S = 600.0
DEFAULT_TIME_LIMIT_S = 3600.0    # no new cell starts after this long (the table says what was left out)


# -- what to run ------------------------------------------------------------------------------------
def row_specs(cfg) -> dict[str, tuple[str | None, dict]]:
    """Row name -> (strategy sent, options sent); the ``default`` row names neither."""
    drafters = cfg.drafters
    drafter = PREFERRED_DRAFTER if PREFERRED_DRAFTER in drafters else cfg.engine.options.get("drafter")
    return {"autoregressive": ("autoregressive", {}),
            "default": (None, {}),
            "speculative": ("speculative", {"k": K, **({"drafter": drafter} if drafter else {})}),
            "mag": ("mag", {"k": MAG_K.default}),
            "cs_drafting": ("cs_drafting", {})}


def parse_choices(name: str, text, allowed: tuple[str, ...]) -> list[str]:
    """``"a,b"`` -> the named ones of ``allowed``, in its order (a ParamError naming ``name`` otherwise)."""
    names = [x.strip() for x in str(text).split(",") if x.strip()]
    if not names or any(n not in allowed for n in names):
        raise ParamError(name, "comma-separated of " + ", ".join(allowed), text)
    return [a for a in allowed if a in names]


def parse_strategies(text) -> list[str]:
    """``"speculative,mag"`` -> rows in :data:`ROWS` order; autoregressive is always added (the reference)."""
    names = [x.strip() for x in str(text).split(",") if x.strip()]
    if not names or any(n not in ROWS for n in names):
        raise ParamError("strategies", "comma-separated of " + ", ".join(ROWS), text)
    return [r for r in ROWS if r in names or r == "autoregressive"]


def parse_levels(text, cap: int) -> tuple[list[int], str | None]:
    """``"1,2,4"`` -> sorted distinct levels, each clamped to ``cap``; plus a note when any was clamped."""
    levels = parse_concurrency(text)
    over = sorted({c for c in levels if c > cap})
    note = (f"concurrency {', '.join(map(str, over))} clamped to {cap} = engine.max_batch + engine.max_queue "
            f"(more clients would be refused with RESOURCE_EXHAUSTED)") if over else None
    return sorted({min(c, cap) for c in levels}), note


def servable(engine, specs: dict, names: list[str]) -> list[str]:
    """The rows the config's models can serve (checked in-process; the served engine is built alike)."""
    out = []
    for name in names:
        strategy, opts = specs[name]
        try:
            engine.prepare(GenerationRequest(prompt_ids=[0], max_new_tokens=1, strategy=strategy, options=opts))
            out.append(name)
        except ParamError as e:
            print(f"[bench served: row {name} skipped: {e}]")
    return out


# -- the cluster ------------------------------------------------------------------------------------
def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def served_config(cfg, topology: str = "separated"):
    """``cfg`` with ``topology`` and the proxies on free 127.0.0.1 ports."""
    grpc_port, http_port = _free_ports(2)
    return dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, topology=topology, grpc_port=grpc_port, http_port=http_port, http_host="127.0.0.1"))


@contextmanager
def serving(scfg, join: bool = False):
    """Serve ``scfg``'s application on its 127.0.0.1 ports and yield a client once its health service says
    SERVING.  ``join``: one more application of the Serve already running, on its own route (that Serve's
    owner shuts it down); otherwise Serve is started here and shut down after, on errors too."""
    from ray import serve
    client = None
    try:
        if join:
            serve.run(build_app(scfg), name=scfg.cluster.app_name, route_prefix=f"/{scfg.cluster.app_name}")
        else:
            start_serve(scfg)
        client = SpecServeClient(f"127.0.0.1:{scfg.cluster.grpc_port}", app=scfg.cluster.app_name,
                                 timeout=REQUEST_TIMEOUT_S, api_key="")
        client.wait_ready(READY_TIMEOUT_S)
        yield client
    finally:
        if client is not None:
            client.close()
        if not join:
            try:
                serve.shutdown()
            except Exception as e:       # noqa: BLE001 - still go on (Ray's shutdown, the next cell); say what failed
                print(f"[bench: serve.shutdown() failed: {type(e).__name__}: {e}]")


# -- the suite --------------------------------------------------------------------------------------
@dataclass
class Results:
    table: list[dict]
    cells: dict[tuple[str, str, int], Cell]      # (runtime, row, c); runtime = topology/mode or in-process
    mismatches: list[tuple]
    rows: list[str]
    levels: list[int]
    summary: list[dict] = dataclasses.field(default_factory=list)


@dataclass
class Plan:
    """What one run measures (parsed from the arguments)."""

    prompts: list
    rows: list[str]
    levels: list[int]
    modes: list[str]
    topologies: list[str]
    max_new: int
    rpc: int | None
    time_limit: float
    per_cell: int | None = None      # requests per cell, at least c (when no requests per client is given)


def _draft_timing(scfg) -> dict | None:
    """The replica's draft-call totals since the last call (which this resets); None when colocated."""
    from ray import serve
    try:
        return serve.get_app_handle(scfg.cluster.app_name).draft_timing.remote(True).result(timeout_s=60)
    except Exception as e:                   # noqa: BLE001 - the table then has no hop columns for the cell
        print(f"[bench served: draft timing not read: {type(e).__name__}: {e}]")
        return None


def _measure_topology(cfg, label: str, plan: Plan, specs, engine, cells, bar, start: float) -> int:
    """Serve ``cfg`` in the topology ``label`` names (``separated+socket``: with that draft channel), run its cells
    (each c = 1 row in-process too, paired request by request); returns how many cells the time limit left out.
    Serve is shut down before returning, whatever happens."""
    topology, channel = split_label(label)
    scfg = served_config(cfg, topology)
    if channel:
        scfg = dataclasses.replace(scfg, cluster=dataclasses.replace(scfg.cluster, draft_channel=channel))
    skipped, first, t0 = 0, label == plan.topologies[0], time.perf_counter()
    with serving(scfg) as client:
        print(f"[bench served: cluster up at 127.0.0.1:{scfg.cluster.grpc_port} in {time.perf_counter() - t0:.1f}s "
              f"(topology {label}, engine.max_batch {cfg.engine.max_batch})]")
        for name in plan.rows:               # warm-up, untimed: one short request per row, mode and runtime
            strategy, opts = specs[name]
            for mode in plan.modes:
                served_cell(client, plan.prompts, 1, 1, min(WARMUP_TOKENS, plan.max_new), strategy, opts,
                            stream=mode == "streamed")
            if first:
                in_process_cell(engine, plan.prompts, 1, min(WARMUP_TOKENS, plan.max_new), strategy, opts)
        for c in plan.levels:
            n = c * plan.rpc if plan.rpc else max(plan.per_cell, c) if plan.per_cell else max(2 * c, 8)
            for name in plan.rows:
                strategy, opts = specs[name]
                for mode in plan.modes:
                    if time.perf_counter() - start > plan.time_limit:
                        skipped += 1
                        continue
                    paired = c == 1 and mode == plan.modes[0]      # each request then in-process, one by one
                    bar.set_postfix_str(f"{label} c={c} {name} {mode}" + (" + in-process" if paired else ""))
                    local: list = []
                    after = pair_with(engine, plan.prompts, plan.max_new, strategy, opts, local) if paired else None
                    _draft_timing(scfg)                  # reset: the cell's draft calls only
                    recs, secs = served_cell(client, plan.prompts, n, c, plan.max_new, strategy, opts,
                                             stream=mode == "streamed", after=after)
                    cells[(f"{label}/{mode}", name, c)] = Cell(name, c, f"{label}/{mode}", recs, secs,
                                                               _draft_timing(scfg))
                    if paired:
                        cells[(in_process(label), name, 1)] = Cell(name, 1, in_process(label), local,
                                                                   request_seconds(local))
                    bar.update(1 + paired)
    return skipped


def _plan(args, cfg, engine) -> Plan:
    n_prompts = check_int("prompts", args.prompts, 1, 256)
    max_new = check_int("max_new_tokens", args.max_new_tokens, 1, cfg.engine.max_new_tokens_limit)
    if check_float("temperature", getattr(args, "temperature", 0) or 0, 0.0, 100.0) != 0:
        print("[bench served: greedy only (outputs are checked against autoregressive); --temperature ignored]")
    cap = cfg.engine.max_batch + cfg.engine.max_queue
    levels, note = parse_levels(getattr(args, "concurrency", None) or ",".join(map(str, LEVELS)), cap)
    if note:
        print(f"[bench served: {note}]")
    rpc = getattr(args, "requests_per_client", None)
    rpc = check_int("requests_per_client", rpc, 1, 10_000) if rpc is not None else None
    per_cell = getattr(args, "requests_per_cell", None)
    per_cell = check_int("requests_per_cell", per_cell, 1, 100_000) if per_cell is not None else None
    time_limit = check_float("time_limit", getattr(args, "time_limit", None) or DEFAULT_TIME_LIMIT_S, 1.0, 1e6)
    modes = parse_choices("modes", getattr(args, "modes", None) or ",".join(MODES), MODES)
    topologies = parse_choices("topologies", getattr(args, "topologies", None) or ",".join(TOPOLOGIES), TOPOLOGIES)
    if getattr(args, "channels", None):      # the separated unit once per draft channel: separated+ray, ...
        channels = parse_choices("channels", args.channels, DRAFT_CHANNELS)
        topologies = [topology_label(t, ch) for t in topologies for ch in (channels if t == "separated" else [""])]
    wanted = parse_strategies(getattr(args, "strategies", None) or ",".join(ROWS))
    prompts = [p["prompt_ids"] for p in heldout_prompts(engine.tokenizer, n_prompts)]
    rows = servable(engine, row_specs(cfg), wanted)
    return Plan(prompts, rows, levels, modes, topologies, max_new, rpc, time_limit, per_cell)


def collect(args, cfg) -> Results:
    """Measure, print the tables, write ``bench_served.{csv,json,png}`` to ``args.out``."""
    t0 = time.perf_counter()
    engine = build_engine(cfg)
    plan = _plan(args, cfg, engine)
    specs = row_specs(cfg)
    legend = "; ".join(f"{r} = {_describe(r, specs[r], cfg)}" for r in plan.rows)
    print(f"[bench served: in-process engine built in {time.perf_counter() - t0:.1f}s; rows: {legend}]")
    cells: dict[tuple[str, str, int], Cell] = {}
    n_cells = (len(plan.levels) * len(plan.modes) + (1 in plan.levels)) * len(plan.rows) * len(plan.topologies)
    with local_ray():
        bar = tqdm(total=n_cells, desc="bench served", unit="cell")
        start, skipped = time.perf_counter(), 0
        for topology in plan.topologies:
            skipped += _measure_topology(cfg, topology, plan, specs, engine, cells, bar, start)
        bar.close()
        if skipped:
            print(f"[bench served: --time-limit {plan.time_limit:g}s reached; {skipped} cells not run]")
    table, summary, mismatches = report(args, cfg, plan, cells)
    return Results(table, cells, mismatches, plan.rows, plan.levels, summary)


def run(args, cfg) -> int:
    return 1 if collect(args, cfg).mismatches else 0


def _describe(name: str, spec: tuple, cfg) -> str:
    strategy, opts = spec
    if strategy is None:
        strategy, opts = cfg.engine.strategy, dict(cfg.engine.options)
    return strategy + (" " + " ".join(f"{k}={v}" for k, v in opts.items()) if opts else "")
