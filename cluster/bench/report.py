"""``specserve bench``: strategies and today's peers, side by side on the same models and prompts.

Suites register in :data:`SUITES` (name -> ``run(args, cfg) -> int``); ``--suite`` picks them.
Every row is measured in the same process and run, interleaved prompt by prompt, so ratios are
comparable on a noisy shared machine.
"""
from __future__ import annotations

import csv
import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster.errors import ParamError, check_int

RUNTIMES = ("in-process", "cluster")       # --runtime of the suites that run both


def parse_ints(name: str, text, low: int, high: int) -> list[int]:
    """A comma-separated option (``"1,2,4"``) -> its integers in order, each in [low, high]; ParamError naming
    ``name`` otherwise."""
    allowed = f"comma-separated integers in [{low}, {high}]"
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ParamError(name, allowed, text) from None
    if not out:
        raise ParamError(name, allowed, text)
    return [check_int(name, v, low, high) for v in out]


def parse_runtimes(text) -> list[str]:
    """``--runtime`` -> the runtimes named, in :data:`RUNTIMES` order."""
    names = [x.strip() for x in str(text).split(",") if x.strip()]
    if not names or any(n not in RUNTIMES for n in names):
        raise ParamError("runtime", "comma-separated of " + ", ".join(RUNTIMES), text)
    return [r for r in RUNTIMES if r in names]


@dataclass
class Timed:
    """One streamed request as its client saw it: submitted, first tokens, last chunk, its tokens; the load
    and served suites' records extend it."""

    submit: float
    first: float | None = None
    last: float | None = None
    token_ids: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.first - self.submit

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first."""
        n = len(self.token_ids)
        return (self.last - self.first) / (n - 1) if n > 1 else 0.0


@dataclass
class Row:
    """One benchmark row: totals over all prompts."""

    name: str
    tokens: int = 0
    seconds: float = 0.0
    target_calls: int = 0
    draft_calls: int = 0
    accepted: int = 0
    steps: int = 0
    extra: dict = field(default_factory=dict)

    def record(self, stats, seconds: float) -> None:
        """Add one generation's :class:`cluster.core.stats.RequestStats` and its wall time."""
        self.seconds += seconds
        self.tokens += stats.generated_tokens
        self.target_calls += stats.target_forwards
        self.draft_calls += sum(stats.drafter_forwards.values())
        self.accepted += stats.accepted_tokens
        self.steps += stats.steps

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def accepted_per_call(self) -> float:
        """Mean accepted draft tokens per target verification call."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def calls_per_token(self) -> float:
        return self.target_calls / self.tokens if self.tokens else 0.0

    def as_dict(self, baseline: "Row | None" = None) -> dict:
        d = dict(name=self.name, tokens=self.tokens, seconds=round(self.seconds, 4),
                 tokens_per_s=round(self.tokens_per_s, 2),
                 speedup=round(self.tokens_per_s / baseline.tokens_per_s, 3) if baseline and
                 baseline.tokens_per_s else None,
                 accepted_per_call=round(self.accepted_per_call, 3),
                 target_calls_per_token=round(self.calls_per_token, 4),
                 draft_calls_per_token=round(self.draft_calls / self.tokens, 4) if self.tokens else 0.0)
        d.update(self.extra)
        return d


def print_table(rows: list[dict], title: str = "", file=None) -> None:
    """A plain-text table of dicts (columns: union of keys, in first-seen order), to ``file`` or the standard output
    of the moment (looked up when called, so that a redirected or captured one gets it)."""
    file = file or sys.stdout
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    if title:
        print(f"\n== {title} ==", file=file)
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)), file=file)


def write_results(rows: list[dict], out_dir: Path, stem: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(rows, indent=2))
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with open(out_dir / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def save_concurrency_plot(fig, panels, levels: list[int], xlabel: str, path: Path) -> None:
    """Finish a figure whose panels are plotted against concurrency (``panels`` = [(axis, y label)]): log2 x
    with a tick per measured level, labels and grid; then save it to ``path`` (120 dpi)."""
    for ax, ylabel in panels:
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels)
        ax.set_xticklabels([str(c) for c in levels])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile of ``xs`` (0 for none)."""
    return float(np.percentile(xs, q)) if xs else 0.0


def hop_columns(t: dict | None) -> dict:
    """A draft-call total (``CallTiming`` as a dict) -> per-call milliseconds by hop; {} without calls."""
    if t and "cache" in t:
        return cache_columns(t["cache"])
    if not t or not t.get("calls"):
        return {}
    n, hit_n = t["calls"], t["hit_calls"]

    def ms(seconds: float, over: int = n):
        return round(1e3 * seconds / over, 3) if over else None
    return {"draft_calls": n, "draft_ms": ms(t["wall_s"]), "request_hop_ms": ms(t["request_s"]),
            "actor_ms": ms(t["actor_s"]), "wait_ms": ms(t["wait_s"]), "compute_ms": ms(t["compute_s"]),
            "reply_hop_ms": ms(t["reply_s"]), "beyond_compute_ms": ms(t["wall_s"] - t["compute_s"]),
            "hit_share": round(hit_n / n, 3), "hit_compute_ms": ms(t["hit_compute_s"], hit_n),
            "miss_compute_ms": ms(t["compute_s"] - t["hit_compute_s"], n - hit_n), "disordered": t["disordered"]}


def cache_columns(c: dict) -> dict:
    """The speculation cache's counters (``CacheCounters`` as a dict, the ``speculator`` topology) -> the share of
    speculative steps served from the cache, by branch kind (``known``: a miss step's own sequence, drafted far
    alongside near), late answers, wasted draft tokens per step, the fan-out (branches per fill), and the
    coordinator's time per draft call when every block was a hit (its whole cost: no drafting) and over all
    calls; ``raced_share``: steps served by a late answer that came while near drafted (counted in the hits too),
    ``raced_near``: near drafting rounds done before it came, per such step; ``ahead_share``: steps whose answer
    the speculator had drafted before the fill came (``Speculator.ahead``); {} without steps."""
    n = c.get("steps", 0)
    if not n:
        return {}
    hits = c["hits_bonus"] + c["hits_reject"] + c.get("hits_known", 0)
    return {"cache_steps": n, "cache_hit_share": round(hits / n, 3), "hit_bonus": round(c["hits_bonus"] / n, 3),
            "hit_reject": round(c["hits_reject"] / n, 3), "hit_known": round(c.get("hits_known", 0) / n, 3),
            "late_share": round(c["late"] / n, 3),
            "wasted_per_step": round(c["wasted"] / n, 2), "fanout": round(c["rows"] / c["fills"], 2) if c["fills"] else 0,
            "hit_call_ms": round(1e3 * c["hit_s"] / c["hit_calls"], 3) if c["hit_calls"] else None,
            "draft_ms": round(1e3 * c["call_s"] / c["calls"], 3) if c["calls"] else None,
            "fill_ms": round(1e3 * c["fill_s"] / c["fills"], 3) if c["fills"] else None,
            "gap_ms": round(1e3 * c["gap_s"] / max(1, c["fills"] + c["late_fills"]), 3),
            "raced_share": round(c.get("raced", 0) / n, 3), "ahead_share": round(c.get("ahead", 0) / n, 3),
            "raced_near": round(c["raced_rounds"] / c["raced"], 2) if c.get("raced") else None}


@contextmanager
def local_ray():
    """A local Ray for a suite's served cells unless the caller already runs one (then shut down, on errors
    and Ctrl-C too)."""
    import ray
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, namespace="specserve-bench")
    try:
        yield
    finally:
        if started:
            ray.shutdown()
