"""The served suite's report (:mod:`cluster.bench.served`): greedy outputs checked against autoregressive's,
the table (ratios to autoregressive and to in-process, failures by status) and the plot."""
from __future__ import annotations

from pathlib import Path

from cluster.bench.report import pct, save_concurrency_plot


def check_outputs(cells) -> list[tuple]:
    """Every successful output vs the reference for its prompt: the first autoregressive output for that
    prompt (served cells first, then in-process).  Returns (runtime, row, c, request, prompt, first
    differing position, expected token, got token) per mismatch."""
    ref: dict[int, list[int]] = {}
    order = sorted(cells.values(), key=lambda cl: (cl.runtime != "served", cl.row != "autoregressive", cl.c))
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


def make_table(cells, rows, levels, mismatches) -> list[dict]:
    bad: dict[tuple[str, int], int] = {}
    for runtime, name, c, *_ in mismatches:
        bad[(name, c)] = bad.get((name, c), 0) + 1
    table = []
    for c in levels:
        ar = cells.get(("served", "autoregressive", c))
        for name in rows:
            m = cells.get(("served", name, c))
            if m is None:
                continue
            ip = cells.get(("in-process", name, c))
            ok = m.ok
            fails = m.failures()
            table.append({
                "strategy": name, "concurrency": c, "requests": len(m.recs), "tokens": m.tokens,
                "seconds": round(m.seconds, 3), "tok_s": round(m.tok_s, 1),
                "vs_autoregressive": round(m.tok_s / ar.tok_s, 3) if ar and ar.tok_s else None,
                "ttft_p50": round(1e3 * pct([r.ttft for r in ok], 50), 2),
                "ttft_p99": round(1e3 * pct([r.ttft for r in ok], 99), 2),
                "tpot_p50": round(1e3 * pct([r.tpot for r in ok], 50), 2),
                "tpot_p99": round(1e3 * pct([r.tpot for r in ok], 99), 2),
                "in_process_tok_s": round(ip.tok_s, 1) if ip else None,
                "cluster_vs_in_process": round(m.tok_s / ip.tok_s, 3) if ip and ip.tok_s else None,
                "mismatches": bad.get((name, c), 0),
                "failures": sum(fails.values()),
                "failed_by_status": " ".join(f"{k}:{v}" for k, v in sorted(fails.items())) or None})
    return table


def plot(cells, rows, levels, path: Path) -> None:
    """Two panels vs concurrency (log2 x), a line per row: served tok/s (in-process c=1 as an x), and the
    ratio to autoregressive at the same concurrency with a dashed line at 1.0."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in rows:
        pts = [(c, cells[("served", name, c)]) for c in levels if ("served", name, c) in cells]
        if not pts:
            continue
        line, = ax1.plot([c for c, _ in pts], [m.tok_s for _, m in pts], "-", marker="o", label=name)
        ip = cells.get(("in-process", name, 1))
        if ip is not None:
            ax1.plot([1], [ip.tok_s], "x", color=line.get_color(), markersize=9)
        ratio = [(c, m.tok_s / cells[("served", "autoregressive", c)].tok_s) for c, m in pts
                 if ("served", "autoregressive", c) in cells and cells[("served", "autoregressive", c)].tok_s]
        ax2.plot([c for c, _ in ratio], [r for _, r in ratio], "-", marker="o", color=line.get_color(), label=name)
    ax2.axhline(1.0, linestyle="--", color="gray", linewidth=1)
    ax1.set_title("served throughput (separated topology)")
    ax2.set_title("ratio to autoregressive, same concurrency")
    ax1.legend(fontsize=8)
    save_concurrency_plot(fig, [(ax1, "output tokens/s (x: in-process, c=1)"), (ax2, "tokens/s / autoregressive's")],
                          levels, "concurrency (closed-loop gRPC clients)", path)
    plt.close(fig)
