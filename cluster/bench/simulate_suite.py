"""``specserve bench --suite simulate``: the served-step simulation checked against a measured served table,
then the production-70b projection (issue 32 item 5).

1. **Inputs, measured now in-process** (:mod:`cluster.bench.simulate_inputs`): forward-cost tables, prefill,
   each row's replayable acceptance and the engine's work per step, on ``--prompts`` held-out prompts x
   ``--max-new-tokens``.
2. **The check** (``--measured PATH``: a ``bench_served.json`` the served suite wrote, unary cells): the served
   step's own work per step and per token is fitted on the autoregressive cells of each topology at c = 1 and at
   the largest c (:func:`cluster.bench.simulate_inputs.fit_served`) -- the only fitted parameters -- and every
   other unary cell is simulated with the same clients, requests and tokens; the table gives measured and
   simulated tok/s and ratio to autoregressive, the error of each and whether it is within 10 % (the ratio:
   what the check is about; tok/s: also the batching, and the drift between the served run and this one).
   Rows the load-aware planner plans are simulated at their strategy's fixed k and not counted ("planned"):
   their k moves with the planner, which the simulation does not model.  The ``speculator`` topology's neural
   drafting is simulated with its cache (:meth:`cluster.bench.simulate._Sim.speculate`), whose share of steps
   with every answer in time is measured in-process (:func:`cluster.bench.simulate_inputs.measure_cache`); the
   table puts the simulated hits beside the served run's; its Max-Gram and CS Drafting rows draft near.
   Without ``--measured`` the simulated cells of ``--concurrency`` (default 1,4,16) are printed unchecked.
3. **The projection** of ``configs/production-70b.yaml`` (:mod:`cluster.bench.projection`, cited inputs) at
   batch 1, 4, 16, 32.

Writes ``simulate_inputs``, ``simulate_calibration`` and ``simulate_projection`` ``.{csv,json}`` to ``--out``.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from cluster.bench.projection import believed, project
from cluster.bench.report import print_table, write_results
from cluster.bench.served import row_specs, servable
from cluster.bench.simulate import replicate
from cluster.bench.simulate_inputs import fit_served, measure_inputs
from cluster.bench.load import parse_concurrency
from cluster.errors import ParamError, check_int
from cluster.family.corpus import heldout_prompts
from cluster.local import build_engine
from cluster.strategies import resolve_options

ROWS = ("autoregressive", "default", "mag")
TOLERANCE = 0.10


def load_measured(path) -> list[dict]:
    """The unary cells of a served suite's ``bench_served.json``."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ParamError("measured", "a bench_served.json the served suite wrote", f"{path} ({e})") from e
    cells = [r for r in rows if isinstance(r, dict) and r.get("mode") == "unary" and r.get("tok_s")]
    if not any(r["strategy"] == "autoregressive" and r["concurrency"] == 1 for r in cells):
        raise ParamError("measured", "a served table with an autoregressive unary cell at c = 1", path)
    return cells


def _within(error_pct: float | None) -> str:
    return "-" if error_pct is None else "yes" if abs(error_pct) <= 100 * TOLERANCE else "NO"


def _err(sim: float, meas: float | None) -> float | None:
    return round(100.0 * (sim - meas) / meas, 1) if meas else None


def calibrate(inp, measured: list[dict], max_new: int) -> list[dict]:
    """One row per measured unary cell: measured vs simulated tok/s (pooled over seeds) and ratio to
    autoregressive."""
    by = {m.name: m for m in inp.strategies}
    ar = {(r["topology"], r["concurrency"]): r for r in measured if r["strategy"] == "autoregressive"}
    first = next((r["in_process_tok_s"] for (_, c), r in ar.items() if c == 1 and r.get("in_process_tok_s")), None)
    out, sim_ar = [], {}
    for topology in dict.fromkeys(r["topology"] for r in measured):
        if (topology, 1) not in ar:
            continue
        # each topology at the machine's speed while it ran, by its own in-process cell (the served suite runs one
        # beside each topology's c = 1 cells: minutes apart, this host's speed drifts ~10 %); else the first one
        inp.at_speed(ar[(topology, 1)].get("in_process_tok_s") or first)
        ar_cells = {c: r for (t, c), r in ar.items() if t == topology}
        served = fit_served(inp, ar_cells, max_new, topology)
        cells = sorted((r for r in measured if r["topology"] == topology and r["strategy"] in by),
                       key=lambda r: (r["concurrency"], r["strategy"] != "autoregressive"))
        for r in cells:
            c, m = r["concurrency"], by[r["strategy"]]
            hops = (r.get("miss_compute_ms"), r.get("beyond_compute_ms"))       # the draft call's, measured
            call = None if None in hops else tuple(ms / 1e3 for ms in hops)
            res = replicate(inp.unit(served, topology), inp.strategy(m, topology, call, c), c, r["requests"], max_new)
            if m.k == 0:
                sim_ar[(topology, c)] = res.tok_s
            base = sim_ar.get((topology, c))
            ratio = res.tok_s / base if base else None
            meas_ratio = r.get("vs_autoregressive")
            fitted = m.k == 0 and c in (1, max(ar_cells))
            planned = m.options.get("plan") == "load_aware"
            e_tok, e_ratio = _err(res.tok_s, r["tok_s"]), _err(ratio, meas_ratio) if ratio else None
            out.append(dict(topology=topology, c=c, strategy=r["strategy"], speed=round(inp.speed, 3),
                            served_ms_per_step=round(served[0] * 1e3, 3), served_ms_per_token=round(served[1] * 1e3, 4),
                            measured_tok_s=r["tok_s"], simulated_tok_s=round(res.tok_s, 1), tok_s_error_pct=e_tok,
                            measured_ratio=meas_ratio, simulated_ratio=round(ratio, 3) if ratio else None,
                            ratio_error_pct=e_ratio, sim_step_ms=round(res.step_ms, 2),
                            sim_tokens_per_step=round(res.tokens_per_row_step, 2),
                            sim_predraft_hits=round(res.hit_rate, 2), measured_cache_hits=r.get("cache_hit_share"),
                            ratio_within_10pct="reference" if m.k == 0 else "planned" if planned else _within(e_ratio),
                            tok_s_within_10pct="fitted" if fitted else "planned" if planned else _within(e_tok)))
    return out


def _input_rows(inp) -> list[dict]:
    rows = [dict(what=f"target forward, {r} rows x {t} tokens", ms=round(1e3 * s, 3))
            for (r, t), s in sorted(inp.target.table.items())]
    rows += [dict(what=f"prefill, {r} rows x {inp.prompt_len} tokens", ms=round(1e3 * s, 3))
             for (r, _), s in sorted(inp.prefill.table.items())]
    for name, (cost, _) in inp.drafters.items():
        rows += [dict(what=f"{name} forward, {r} rows x 1 token", ms=round(1e3 * s, 3))
                 for (r, _), s in sorted(cost.table.items())]
    for m in inp.strategies:
        rows.append(dict(what=f"{m.name}: engine work per step at rows {', '.join(f'{r:.1f}' for r, _ in m.overhead)}",
                         ms=" / ".join(f"{1e3 * o:.3f}" for _, o in m.overhead),
                         accepted_of_k=" ".join(f"{a:.3f}" for a in m.accepted) if m.accepted else None,
                         alpha=round(m.alpha, 3) if m.k else None,
                         cache_hits_in_time=None if m.cache_hits is None else round(m.cache_hits, 3),
                         in_process_step_ms=" / ".join(f"{v}" for v in m.step_ms.values())))
    return rows


def run(args, cfg) -> int:
    n = check_int("prompts", args.prompts, 1, 256)
    max_new = check_int("max_new_tokens", args.max_new_tokens, 1, cfg.engine.max_new_tokens_limit)
    measured = load_measured(args.measured) if getattr(args, "measured", None) else None
    # measured speculating at every batch size: the simulation decodes plainly from plain_from_batch rows itself
    measuring = replace(cfg, engine=replace(cfg.engine, plain_from_batch=None))
    engine = build_engine(measuring)
    prompts = [p["prompt_ids"] for p in heldout_prompts(engine.tokenizer, n)]
    specs = row_specs(cfg)
    default = resolve_options(cfg.engine.strategy, {}, dict(cfg.engine.options))    # what a request naming none gets
    specs["default"] = (cfg.engine.strategy, {k: v for k, v in default.items() if v is not None})
    named = {r["strategy"] for r in measured} if measured else set(ROWS)
    wanted = ["autoregressive"] + sorted(named - {"autoregressive"})
    wanted = servable(engine, specs, [r for r in wanted if r in specs])
    far = None                      # the speculation cache's hits with every answer in time, for the speculator's cells
    if measured and any(r["topology"] == "speculator" for r in measured):
        far = build_engine(measuring, speculator=True)
    inp = measure_inputs(engine, cfg, prompts, max_new, {r: specs[r] for r in wanted}, far=far)
    out = Path(args.out)
    inputs = _input_rows(inp)
    print_table(inputs, f"simulate: inputs measured in-process now ({cfg.source}; {n} prompts x {max_new} tokens)")
    write_results(inputs, out, "simulate_inputs")
    if measured is None:
        levels = parse_concurrency(getattr(args, "concurrency", None) or "1,4,16")
        measured = [dict(topology=t, mode="unary", strategy=m.name, concurrency=c, requests=max(2 * c, 8),
                         tok_s=None, vs_autoregressive=None) for t in ("separated", "colocated") for c in levels
                    for m in inp.strategies]
        print("[bench simulate: no --measured served table: simulated cells unchecked; served step's own work 0]")
        table = _unchecked(inp, measured, max_new)
    else:
        table = calibrate(inp, measured, max_new)
    counts = {key: (sum(r.get(key) == "yes" for r in table), sum(r.get(key) in ("yes", "NO") for r in table))
              for key in ("ratio_within_10pct", "tok_s_within_10pct")}
    (ratio_ok, ratio_n), (tok_ok, tok_n) = counts.values()
    print_table(table, f"simulate: calibration against {getattr(args, 'measured', None) or '(nothing)'} "
                       f"(in-process costs x speed: the machine's speed then, by each topology's in-process cell); "
                       f"served step fitted on autoregressive at c=1 and the largest c; within 10 %: ratio to "
                       f"autoregressive "
                       f"{ratio_ok}/{ratio_n} drafting cells, tok/s {tok_ok}/{tok_n} cells")
    write_results(table, out, "simulate_calibration")
    proj = project()
    print_table(proj, "simulate: projection for configs/production-70b.yaml (TP=8, drafters on their own GPU; "
                      "inputs in cluster/bench/projection.py: forward costs measured on a lent H200, the rest cited) "
                      f"-- {believed(ratio_ok, ratio_n) if getattr(args, 'measured', None) else believed()}")
    write_results(proj, out, "simulate_projection")
    print(f"results written to {out}/simulate_{{inputs,calibration,projection}}.{{csv,json}}")
    return 0


def _unchecked(inp, cells, max_new) -> list[dict]:
    by = {m.name: m for m in inp.strategies}
    return [dict(topology=r["topology"], c=r["concurrency"], strategy=r["strategy"],
                 simulated_tok_s=round(res.tok_s, 1), sim_step_ms=round(res.step_ms, 2),
                 sim_predraft_hits=round(res.hit_rate, 2), ratio_within_10pct="unchecked")
            for r in cells
            for res in [replicate(inp.unit((0.0, 0.0), r["topology"]), inp.strategy(by[r["strategy"]], r["topology"]),
                                 r["concurrency"], r["requests"], max_new)]]
