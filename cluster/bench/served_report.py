"""The served suite's report (:mod:`cluster.bench.served`): greedy outputs checked against autoregressive's,
the table (ratios to autoregressive, streamed / unary and to in-process, failures by status), the side-by-side
summary and the plot."""
from __future__ import annotations

from pathlib import Path

from cluster.bench.projection import project
from cluster.bench.report import hop_columns, pct, print_table, save_concurrency_plot, write_results
from cluster.bench.served_cells import in_process

MAX_PRINTED_MISMATCHES = 20


def check_outputs(cells) -> list[tuple]:
    """Every successful output vs the reference for its prompt: the first autoregressive output for that
    prompt (served cells first, then in-process).  Returns (runtime, row, c, request, prompt, first
    differing position, expected token, got token) per mismatch."""
    ref: dict[int, list[int]] = {}
    order = sorted(cells.values(), key=lambda cl: (cl.runtime.startswith("in-process"), cl.row != "autoregressive",
                                                   cl.c))
    for cl in order:
        if cl.row == "autoregressive":
            for r in cl.ok:
                ref.setdefault(r.prompt, r.token_ids)
    out = []
    for cl in order:
        for j, r in enumerate(cl.recs):
            want = ref.get(r.prompt)
            if r.error is not None or want is None or r.token_ids == want:
                continue
            pos = next((i for i, (a, b) in enumerate(zip(want, r.token_ids)) if a != b), min(len(want),
                                                                                           len(r.token_ids)))
            out.append((cl.runtime, cl.row, cl.c, j, r.prompt, pos, want[pos] if pos < len(want) else None,
                        r.token_ids[pos] if pos < len(r.token_ids) else None))
    return out


def _ratio(a, b) -> float | None:
    return round(a.tok_s / b.tok_s, 3) if a is not None and b is not None and b.tok_s else None


def make_table(cells, rows, levels, mismatches, runtimes) -> list[dict]:
    """One row per (runtime = topology/mode, concurrency, strategy): tok/s, its ratio to autoregressive in the
    same runtime, streamed / unary of the same strategy and topology, TTFT / TPOT (streamed only: a unary
    client sees no first token), and at c = 1 the in-process tok/s and the ratio to it."""
    bad: dict[tuple[str, str, int], int] = {}
    for runtime, name, c, *_ in mismatches:
        bad[(runtime, name, c)] = bad.get((runtime, name, c), 0) + 1
    table = []
    for runtime in runtimes:
        topology, mode = runtime.split("/")
        for c in levels:
            ar = cells.get((runtime, "autoregressive", c))
            for name in rows:
                m = cells.get((runtime, name, c))
                if m is None:
                    continue
                ip = cells.get((in_process(topology), name, c))
                ok, fails = m.ok, m.failures()
                timed = m.streamed and ok
                table.append({
                    "topology": topology, "mode": mode, "strategy": name, "concurrency": c,
                    "requests": len(m.recs), "tokens": m.tokens, "seconds": round(m.seconds, 3),
                    "tok_s": round(m.tok_s, 1), "vs_autoregressive": _ratio(m, ar),
                    "chunks_per_request": round(sum(r.chunks for r in ok) / len(ok), 1) if ok else None,
                    "streamed_vs_unary": _ratio(m, cells.get((f"{topology}/unary", name, c))) if m.streamed else None,
                    "ttft_p50": round(1e3 * pct([r.ttft for r in ok], 50), 2) if timed else None,
                    "ttft_p99": round(1e3 * pct([r.ttft for r in ok], 99), 2) if timed else None,
                    "tpot_p50": round(1e3 * pct([r.tpot for r in ok], 50), 2) if timed else None,
                    "tpot_p99": round(1e3 * pct([r.tpot for r in ok], 99), 2) if timed else None,
                    "in_process_tok_s": round(ip.tok_s, 1) if ip else None,
                    "cluster_vs_in_process": _ratio(m, ip),
                    "mismatches": bad.get((runtime, name, c), 0),
                    "failures": sum(fails.values()),
                    "failed_by_status": " ".join(f"{k}:{v}" for k, v in sorted(fails.items())) or None,
                    **hop_columns(m.hops)})
    return table


def side_by_side(table: list[dict], rows, levels, topologies) -> list[dict]:
    """The issue's summary, one line per (topology, c): autoregressive tok/s unary and streamed and their
    ratio, every other strategy's ratio to autoregressive unary / streamed, TTFT p50 (streamed) of
    autoregressive and of the default."""
    at = {(r["topology"], r["mode"], r["strategy"], r["concurrency"]): r for r in table}
    out = []
    for topology in topologies:
        for c in levels:
            u, st = at.get((topology, "unary", "autoregressive", c)), at.get((topology, "streamed", "autoregressive", c))
            if u is None and st is None:
                continue
            line = {"topology": topology, "c": c, "ar_unary_tok_s": u and u["tok_s"],
                    "ar_streamed_tok_s": st and st["tok_s"], "ar_streamed/unary": st and st["streamed_vs_unary"]}
            for name in rows:
                if name == "autoregressive":
                    continue
                pair = [at.get((topology, mode, name, c)) for mode in ("unary", "streamed")]
                line[name] = " / ".join("-" if r is None or r["vs_autoregressive"] is None else
                                        f"{r['vs_autoregressive']:.2f}" for r in pair)
            d = at.get((topology, "streamed", "default", c))
            line["ttft_p50_ar/default"] = f"{st['ttft_p50'] if st else '-'} / {d['ttft_p50'] if d else '-'}"
            out.append(line)
    return out


def topology_verdict(table: list[dict], topologies, picked: str) -> list[dict]:
    """What ``topology: auto`` is judged by: per mode and c, the ``default`` row's tok/s in each topology measured
    (a request naming no strategy, as users send), the fastest of them and its lead over the one ``auto`` picks for
    this config (``picked``, :meth:`cluster.config.layout.ClusterSpec.placement`); empty unless ``picked`` and
    another topology were both measured."""
    names = [t for t in topologies if "+" not in t]
    if picked not in names or len(names) < 2:
        return []
    at = {(r["topology"], r["mode"], r["concurrency"]): r["tok_s"] for r in table if r["strategy"] == "default"}
    out = []
    for mode, c in dict.fromkeys((m, c) for _, m, c in at):
        speeds = {t: at.get((t, mode, c)) for t in names}
        if speeds[picked] is None or None in speeds.values():
            continue
        fastest = max(speeds, key=speeds.get)
        out.append({"mode": mode, "c": c, **{f"{t}_tok_s": v for t, v in speeds.items()}, "auto": picked,
                    "fastest": fastest, "fastest_vs_auto": round(speeds[fastest] / speeds[picked], 3)})
    return out


def plot(cells, rows, levels, runtimes, path: Path) -> None:
    """Per topology two panels vs concurrency (log2 x), a line per row, unary solid and streamed dashed: served
    tok/s (in-process c=1 as an x), and the ratio to autoregressive of the same mode with a dashed line at 1.0."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    topologies = list(dict.fromkeys(r.split("/")[0] for r in runtimes))
    fig, axes = plt.subplots(len(topologies), 2, figsize=(12, 4.5 * len(topologies)), squeeze=False)
    colors = {name: f"C{i}" for i, name in enumerate(rows)}
    for (ax1, ax2), topology in zip(axes, topologies):
        for runtime in [r for r in runtimes if r.startswith(topology + "/")]:
            style = "--" if runtime.endswith("/streamed") else "-"
            for name in rows:
                pts = [(c, cells[(runtime, name, c)]) for c in levels if (runtime, name, c) in cells]
                if not pts:
                    continue
                ax1.plot([c for c, _ in pts], [m.tok_s for _, m in pts], style, marker="o", color=colors[name],
                         label=f"{name} ({runtime.split('/')[1]})")
                ar = {c: cells.get((runtime, "autoregressive", c)) for c, _ in pts}
                ratio = [(c, m.tok_s / ar[c].tok_s) for c, m in pts if ar[c] is not None and ar[c].tok_s]
                ax2.plot([c for c, _ in ratio], [r for _, r in ratio], style, marker="o", color=colors[name])
        for name in rows:
            ip = cells.get((in_process(topology), name, 1))
            if ip is not None:
                ax1.plot([1], [ip.tok_s], "x", color=colors[name], markersize=9)
        ax2.axhline(1.0, linestyle=":", color="gray", linewidth=1)
        ax1.set_title(f"served throughput ({topology}; solid unary, dashed streamed)")
        ax2.set_title(f"ratio to autoregressive, same mode and concurrency ({topology})")
        ax1.legend(fontsize=7)
        save_concurrency_plot(fig, [(ax1, "output tokens/s (x: in-process, c=1)"),
                                    (ax2, "tokens/s / autoregressive's")],
                              levels, "concurrency (closed-loop gRPC clients)", path)
    plt.close(fig)


def report(args, cfg, plan, cells) -> tuple[list[dict], list[dict], list[tuple]]:
    """Check the outputs, print the whole table and the side-by-side summary, write them and the plot to
    ``args.out``, print the projection and the losslessness line; returns (table, summary, mismatches)."""
    runtimes = [f"{t}/{m}" for t in plan.topologies for m in plan.modes]
    mismatches = check_outputs(cells)
    table = make_table(cells, plan.rows, plan.levels, mismatches, runtimes)
    print_table(table, f"served: gRPC unary and streamed, {', '.join(plan.topologies)}, closed loop, "
                       f"{len(plan.prompts)} held-out prompts x {plan.max_new} tokens, greedy, ignore_eos, config "
                       f"{cfg.source}; ttft/tpot in ms (streamed); cluster_vs_in_process at c=1")
    summary = side_by_side(table, plan.rows, plan.levels, plan.topologies)
    print_table(summary, "side by side: autoregressive tok/s unary and streamed; every other row's tok/s / "
                         "autoregressive's as unary / streamed; TTFT p50 ms (streamed) autoregressive / default")
    picked, why = cfg.cluster.placement() if cfg.cluster.topology == "auto" else ("", "")
    verdict = topology_verdict(table, plan.topologies, picked)
    if verdict:
        print_table(verdict, f"topology auto: the default row's tok/s per topology; auto picks {picked} here ({why})")
    out = Path(args.out)
    write_results(table, out, "bench_served")
    write_results(summary, out, "bench_served_summary")
    if verdict:
        write_results(verdict, out, "bench_served_topologies")
    plot(cells, plan.rows, plan.levels, runtimes, out / "bench_served.png")
    print(f"results written to {out / 'bench_served'}.{{csv,json,png}} and {out / 'bench_served_summary'}.{{csv,json}}")
    print_table(project(), "projection for configs/production-70b.yaml's layout (one decode step, closed form on "
                           "the per-step costs and acceptance rates in cluster/bench/projection.py)")
    checked = sum(len(cl.ok) for cl in cells.values())
    print(f"lossless (greedy): {checked - len(mismatches)}/{checked} outputs equal autoregressive's for the "
          f"same prompt" + ("" if not mismatches else "  <-- MISMATCH"))
    for runtime, name, c, j, p, pos, want, got in mismatches[:MAX_PRINTED_MISMATCHES]:
        print(f"  mismatch: {runtime} {name} c={c} request {j} (prompt {p}): first difference at token {pos}: "
              f"expected {want}, got {got}")
    if len(mismatches) > MAX_PRINTED_MISMATCHES:
        print(f"  ... and {len(mismatches) - MAX_PRINTED_MISMATCHES} more")
    failed = {k: v for cl in cells.values() for k, v in cl.failures().items()}
    if failed:
        print(f"WARNING: failed requests by gRPC status: {failed}")
    return table, summary, mismatches
