"""The load test's outputs: the per-stage table, CSV and JSON files and the PNG timeline.

Needs no locust and no Ray (matplotlib is imported only to draw).
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

from cluster.loadtest.stats import METRICS, PERCENTILES

STEM = "loadtest"
_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}


def _num(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(rows: list[dict]) -> str:
    """One line per stage; latency cells are ``p50/p90/p99`` in ms; ``sent/s``: the offered rate measured
    (requests over the stage's sending window)."""
    head = ["stage", "load", "proto", "strategy", "sent/s", "sent", "ok", "failed", "req/s", "out tok/s"] + \
        [f"{_NAMES[m]} p50/p90/p99 ms" for m in METRICS]
    body = []
    for r in rows:
        fails = ", ".join(f"{k} {v}" for k, v in r["failures"].items())
        body.append([str(r["stage"]), r["label"], r["protocol"], r["strategy"], _num(r["offered_rps"]),
                     str(r["sent"]), str(r["ok"]),
                     str(r["failed"]) + (f" ({fails})" if fails else ""), _num(r["request_throughput"], 2),
                     _num(r["output_throughput"])] +
                    ["/".join(_num(r[f"{m}_p{q}_ms"]) for q in PERCENTILES) for m in METRICS])
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def format_markdown(rows: list[dict]) -> str:
    """The same table as Markdown (for notes and docs)."""
    lines = ["| load | proto | strategy | sent/s | ok / sent | failed | req/s | out tok/s | TTFT p50/p99 ms | "
             "TPOT p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms |", "|" + "---|" * 12]
    for r in rows:
        fails = ", ".join(f"{k} {v}" for k, v in r["failures"].items()) or "0"
        lat = ["/".join(_num(r[f"{m}_p{q}_ms"]) for q in (50, 99)) for m in METRICS]
        lines.append(f"| {r['label']} | {r['protocol']} | {r['strategy']} | {_num(r['offered_rps'])} | "
                     f"{r['ok']} / {r['sent']} | {fails} | "
                     f"{_num(r['request_throughput'], 2)} | {_num(r['output_throughput'])} | " + " | ".join(lat) + " |")
    return "\n".join(lines)


def _write_csv(path: Path, rows: list[dict]) -> None:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()})


def write_outputs(out_dir: Path, result: dict, *, plot: bool = True) -> dict[str, Path]:
    """``loadtest.json`` (everything), ``loadtest_stages.csv``, ``loadtest_requests.csv``,
    ``loadtest_timeline.csv`` and ``loadtest_timeline.png`` in ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / f"{STEM}.json", "stages_csv": out_dir / f"{STEM}_stages.csv",
             "requests_csv": out_dir / f"{STEM}_requests.csv", "timeline_csv": out_dir / f"{STEM}_timeline.csv"}
    files["json"].write_text(json.dumps(result, indent=2))
    _write_csv(files["stages_csv"], result["stages"])
    _write_csv(files["requests_csv"], [{k: v for k, v in r.items() if k not in ("t", "token_ids")}
                                       for r in result["requests"]])
    _write_csv(files["timeline_csv"], result["timeline"])
    if plot:
        files["png"] = out_dir / f"{STEM}_timeline.png"
        plot_timeline(files["png"], result["timeline"], result["stage_windows"])
    return files


def plot_timeline(path: Path, rows: list[dict], windows: list[dict]) -> None:
    """Three panels over time: offered / completed / failed requests per second; p99 TTFT; replicas.
    Stage boundaries are shaded and labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    step = rows[1]["t_s"] - rows[0]["t_s"] if len(rows) > 1 else 1.0
    t = [r["t_s"] for r in rows] + [rows[-1]["t_s"] + step]          # bin edges: the last bin is drawn too

    def series(key):
        v = [r[key] for r in rows]
        return v + v[-1:]

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, sharex=True, figsize=(10, 7.5), height_ratios=(3, 2, 1.4))
    ax1.step(t, series("offered_rps"), where="post", label="offered (sent/s)", color="tab:blue")
    ax1.step(t, series("completed_rps"), where="post", label="completed OK/s", color="tab:green")
    if any(r["failed_rps"] for r in rows):
        ax1.step(t, series("failed_rps"), where="post", label="failed/s", color="tab:red")
    ax1.set_ylabel("requests / s")
    ax1.legend(loc="upper right", fontsize=8, framealpha=0.8)
    ttft = [(r["t_s"] + step / 2, r["ttft_p99_ms"]) for r in rows if r["ttft_p99_ms"] is not None]
    if ttft:
        ax2.plot(*zip(*ttft), marker=".", color="tab:orange")
    ax2.set_ylabel("p99 TTFT (ms)")
    rep = [(x, v) for x, v in zip(t, series("replicas")) if v is not None]
    if rep:
        ax3.step(*zip(*rep), where="post", color="tab:purple")
        ax3.set_ylim(0, max(v for _, v in rep) + 1)
        ax3.yaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        ax3.text(0.5, 0.5, "replicas not sampled (no --ray-address / replicas callable)", ha="center",
                 va="center", transform=ax3.transAxes, fontsize=8)
    ax3.set_ylabel("replicas")
    ax3.set_xlabel("time since start (s)")
    for i, w in enumerate(windows):
        for ax in (ax1, ax2, ax3):
            ax.axvspan(w["start_s"], w["end_s"], color="0.9" if i % 2 else "0.95", zorder=0)
        ax1.text(w["start_s"], 1.01, " " + w["label"], va="bottom", fontsize=7, transform=ax1.get_xaxis_transform())
    ax1.set_title("specserve loadtest timeline", pad=14)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
