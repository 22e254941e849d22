"""Per-request latencies and per-stage summaries, defined as ``vllm bench serve`` defines them.

For one request sent at time 0 whose output arrived in chunks at times ``c_1 < c_2 < ... < c_m`` and which
ended at ``e2e`` with ``n`` output tokens:

* TTFT (time to first token) = ``c_1``;
* ITL (inter-token latency) = the gaps ``c_{j+1} - c_j`` between successive chunks.  A speculative step
  can deliver several tokens in one chunk, so, as in vLLM, an ITL is per chunk, not per token;
* TPOT (time per output token, first excluded) = ``(e2e - TTFT) / (n - 1)``, for ``n > 1``;
* E2E = ``e2e``.

A stage's request throughput is its successful requests over its duration (its first send to its last
completion); output throughput is their output tokens over the same.  Percentiles are numpy's linear
ones (``np.percentile``), as vLLM's.  Failed requests count by status and add no latencies.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

import numpy as np

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2e")


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), None for no values."""
    arr = np.asarray(list(values), dtype=float)
    return float(np.percentile(arr, q)) if arr.size else None


def ttft(chunks: list[float]) -> float | None:
    return chunks[0] if chunks else None


def itls(chunks: list[float]) -> list[float]:
    return [b - a for a, b in zip(chunks, chunks[1:])]


def tpot(e2e: float, chunks: list[float], out_tokens: int) -> float | None:
    first = ttft(chunks)
    if first is None or out_tokens < 2:
        return None
    return (e2e - first) / (out_tokens - 1)


def latencies(records: list[dict]) -> dict[str, list[float]]:
    """Seconds per metric over the successful records (ITL: every gap of every request)."""
    out: dict[str, list[float]] = {m: [] for m in METRICS}
    for r in records:
        if r["status"] != "OK":
            continue
        first, per_token = ttft(r["chunks"]), tpot(r["e2e"], r["chunks"], r["out"])
        if first is not None:
            out["ttft"].append(first)
        if per_token is not None:
            out["tpot"].append(per_token)
        out["itl"].extend(itls(r["chunks"]))
        out["e2e"].append(r["e2e"])
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000.0 * x, 3)


def summarize(index: int, stage: dict, records: list[dict], start: float | None = None) -> dict:
    """One stage's row: counts, failures by status, throughputs and latency percentiles (ms).

    ``stage`` is :meth:`Stage.to_dict`; ``records`` the stage's requests (``start`` and ``e2e`` in
    seconds, ``chunks``, ``out`` tokens, ``status``); ``start``: when the stage began (default: its first
    send)."""
    starts = [r["start"] for r in records]
    t0 = start if start is not None else (min(starts) if starts else 0.0)
    t1 = max((r["start"] + r["e2e"] for r in records), default=t0)
    duration = max(t1 - t0, 1e-9)
    ok = [r for r in records if r["status"] == "OK"]
    failures = Counter(r["status"] for r in records if r["status"] != "OK")
    out_tokens = sum(r["out"] for r in ok)
    send_window = (max(starts) - t0) if len(starts) > 1 else 0.0
    row = {
        "stage": index, "label": stage["label"], "protocol": stage["request"]["protocol"],
        "strategy": stage["request"]["strategy"] or "(default)",
        "duration_s": round(duration, 3), "sent": len(records), "ok": len(ok), "failed": sum(failures.values()),
        "failures": dict(sorted(failures.items())),
        "offered_rps": round(len(records) / send_window, 3) if send_window > 0 else None,
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(out_tokens / duration, 2),
        "output_tokens": out_tokens,
    }
    lat = latencies(records)
    for m in METRICS:
        row[f"{m}_mean_ms"] = _ms(float(np.mean(lat[m])) if lat[m] else None)
        for q in PERCENTILES:
            row[f"{m}_p{q}_ms"] = _ms(percentile(lat[m], q))
    return row


def timeline(records: list[dict], replicas: list[tuple[float, int | None]], t0: float, t1: float,
             bin_s: float) -> list[dict]:
    """Bins of ``bin_s`` seconds from ``t0`` to ``t1``: offered (sent) and completed (OK) requests per
    second, failures per second, p99 TTFT (ms) of the requests whose first output came in the bin, and the
    serving replicas (the last sample taken by the bin's end; None before any)."""
    n = max(1, math.ceil((t1 - t0) / bin_s))
    sent, done, failed = np.zeros(n), np.zeros(n), np.zeros(n)
    first: list[list[float]] = [[] for _ in range(n)]

    def b(t: float) -> int:
        return min(n - 1, max(0, int((t - t0) // bin_s)))

    for r in records:
        sent[b(r["start"])] += 1
        end = r["start"] + r["e2e"]
        if r["status"] == "OK":
            done[b(end)] += 1
            if r["chunks"]:
                first[b(r["start"] + r["chunks"][0])].append(r["chunks"][0])
        else:
            failed[b(end)] += 1
    samples = sorted((t, v) for t, v in replicas if v is not None)
    rows, k, last = [], 0, None
    for i in range(n):
        edge = t0 + (i + 1) * bin_s
        while k < len(samples) and samples[k][0] <= edge:
            last = samples[k][1]
            k += 1
        rows.append({"t_s": round(i * bin_s, 3), "offered_rps": sent[i] / bin_s, "completed_rps": done[i] / bin_s,
                     "failed_rps": failed[i] / bin_s, "ttft_p99_ms": _ms(percentile(first[i], 99)),
                     "replicas": last})
    return rows


def auto_bin(span_s: float) -> float:
    """A timeline bin: 1 s for runs up to 2 minutes, else about 120 bins."""
    return 1.0 if span_s <= 120 else round(span_s / 120.0, 1)
