"""The load suite's report (:mod:`cluster.bench.load`): the table, the lossless check, the goals with PASS/FAIL,
and the throughput / p99 TPOT plot."""
from __future__ import annotations

from pathlib import Path

from cluster.bench.report import pct, save_concurrency_plot


def make_table(measured, runtimes, rows, levels) -> list[dict]:
    table = []
    for rt in runtimes:
        for name in rows:
            base = measured.get((rt, name, 1))
            for c in levels:
                m = measured[(rt, name, c)]
                ip = measured.get(("in-process", name, c)) if rt != "in-process" else None
                table.append({
                    "runtime": rt, "strategy": name, "concurrency": c, "requests": len(m.recs),
                    "tokens": m.tokens, "seconds": round(m.seconds, 3), "tok_s": round(m.tok_s, 1),
                    "vs_c1": round(m.tok_s / base.tok_s, 3) if base and base.tok_s else None,
                    "ttft_p50": round(1e3 * pct([r.ttft for r in m.recs], 50), 2),
                    "ttft_p99": round(1e3 * pct([r.ttft for r in m.recs], 99), 2),
                    "tpot_p50": round(1e3 * pct([r.tpot for r in m.recs], 50), 2),
                    "tpot_p99": round(1e3 * m.tpot_p99(), 2),
                    "mean_batch": round(m.rows / m.steps, 2) if m.steps else 0.0,
                    "vs_in_process": round(m.tok_s / ip.tok_s, 3) if ip and ip.tok_s else None,
                    **phase_columns(m.phases)})
    return table


def phase_columns(phases: dict) -> dict:
    """In-process: the share of the run's step time in steps that admit requests (``join``) and in steps of fewer
    than c rows at its end (``drain``), and the tokens per ms of the steady steps of c rows (``full``): the part
    that tells one draft length from another.  Autoregressive rows emit in lockstep (two batched joins, no drain);
    speculative rows drift apart, so a short closed loop measures their transients as much as their steady state."""
    total = sum(v[1] for v in phases.values())
    if not total:
        return {"join_share": None, "drain_share": None, "full_tok_per_ms": None}
    full = phases.get("full", [0, 0.0, 0])
    return {"join_share": round(phases.get("join", [0, 0.0])[1] / total, 3),
            "drain_share": round(phases.get("drain", [0, 0.0])[1] / total, 3),
            "full_tok_per_ms": round(full[2] / (1e3 * full[1]), 3) if full[1] else None}


def mismatches(measured) -> tuple[int, int]:
    """Greedy: (requests compared, requests whose output differs from the autoregressive row's for the same
    request in the same runtime and level)."""
    total = bad = 0
    for (rt, name, c), m in measured.items():
        ref = measured.get((rt, "autoregressive", c))
        if ref is None or name == "autoregressive":
            continue
        for a, b in zip(m.recs, ref.recs):
            total += 1
            bad += a.token_ids != b.token_ids
    return total, bad


def lossless_line(measured) -> str:
    """Greedy: every row's output must equal the autoregressive row's for the same request (same runtime)."""
    total, bad = mismatches(measured)
    return (f"lossless (greedy): {total - bad}/{total} requests equal the autoregressive row's output"
            + ("" if not bad else "  <-- MISMATCH"))


def goal_lines(measured, runtimes, rows, levels) -> list[str]:
    """The issue's goals, each with the measured numbers and PASS/FAIL (n/a where a level is missing)."""
    def tps(rt, name, c):
        m = measured.get((rt, name, c))
        return m.tok_s if m else None

    def verdict(ok):
        return "n/a " if ok is None else ("PASS" if ok else "FAIL")

    out = ["goals:"]
    for rt in runtimes:
        a1, a16 = tps(rt, "autoregressive", 1), tps(rt, "autoregressive", 16)
        ok = None if not (a1 and a16) else a16 >= 5 * a1
        out.append(f"  [{verdict(ok)}] {rt}: autoregressive tok/s at c=16 >= 5x c=1: "
                   + (f"{a16 / a1:.2f}x" if a1 and a16 else "needs c=1 and c=16"))
        for name in rows:
            m1, m16 = measured.get((rt, name, 1)), measured.get((rt, name, 16))
            ok = None if not (m1 and m16) else m16.tpot_p99() <= 2 * m1.tpot_p99()
            out.append(f"  [{verdict(ok)}] {rt}: {name}: p99 TPOT at c=16 <= 2x c=1: "
                       + (f"{1e3 * m16.tpot_p99():.2f} vs {1e3 * m1.tpot_p99():.2f} ms "
                          f"({m16.tpot_p99() / m1.tpot_p99():.2f}x)" if m1 and m16 and m1.tpot_p99()
                          else "needs c=1 and c=16"))
    if "cluster" in runtimes and "in-process" in runtimes:
        for name in rows:
            ratios = {c: tps("cluster", name, c) / tps("in-process", name, c) for c in levels
                      if tps("in-process", name, c)}
            ok = all(r >= 0.8 for r in ratios.values()) if ratios else None
            out.append(f"  [{verdict(ok)}] cluster >= 0.8x in-process at every c, {name}: "
                       + ", ".join(f"c={c} {r:.2f}x" for c, r in ratios.items()))
    return out


def plot(measured, runtimes, rows, levels, path: Path) -> None:
    """Two panels: aggregate tok/s and p99 TPOT vs concurrency (log2 x), a line per (runtime, row)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for rt in runtimes:
        for name in rows:
            ms = [measured[(rt, name, c)] for c in levels]
            style = "-" if rt == "in-process" else "--"
            ax1.plot(levels, [m.tok_s for m in ms], style, marker="o", label=f"{rt}: {name}")
            ax2.plot(levels, [1e3 * m.tpot_p99() for m in ms], style, marker="o", label=f"{rt}: {name}")
    ax1.set_title("throughput vs concurrency")
    ax2.set_title("p99 time per output token vs concurrency")
    ax2.legend(fontsize=7)
    save_concurrency_plot(fig, [(ax1, "aggregate output tokens/s"), (ax2, "p99 TPOT (ms)")], levels,
                          "concurrency (closed-loop clients)", path)
    plt.close(fig)
