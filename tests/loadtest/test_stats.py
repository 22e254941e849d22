"""TTFT / TPOT / ITL / E2E and percentiles on literal requests (the ``vllm bench serve`` definitions)."""
from __future__ import annotations

import pytest

from cluster.loadtest.checks import MISMATCH, check_greedy
from cluster.loadtest.stats import (
    auto_bin,
    itls,
    latencies,
    percentile,
    summarize,
    timeline,
    tpot,
    ttft,
)

STAGE = {"label": "c=2", "request": {"protocol": "grpc", "strategy": None}}


def rec(start, e2e, chunks, out, status="OK", **kw):
    return {"start": start, "e2e": e2e, "chunks": chunks, "out": out, "status": status, **kw}


def test_percentiles_are_linear():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)
    assert percentile([10, 20, 30, 40, 50], 99) == pytest.approx(49.6)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_one_request():
    chunks = [0.10, 0.15, 0.35, 0.40]                 # 4 chunks (a speculative step may carry several tokens)
    assert ttft(chunks) == 0.10
    assert itls(chunks) == pytest.approx([0.05, 0.20, 0.05])
    assert tpot(0.50, chunks, 9) == pytest.approx((0.50 - 0.10) / 8)
    assert tpot(0.50, chunks, 1) is None                # one token: no time per output token
    assert ttft([]) is None and itls([]) == [] and tpot(0.5, [], 4) is None    # unary calls


def test_latencies_skip_failures():
    recs = [rec(0.0, 0.5, [0.1, 0.3, 0.5], 5), rec(0.0, 0.01, [], 0, "RESOURCE_EXHAUSTED"),
            rec(1.0, 0.4, [0.2, 0.4], 3)]
    lat = latencies(recs)
    assert lat["ttft"] == [0.1, 0.2]
    assert lat["tpot"] == pytest.approx([0.1, 0.1])
    assert lat["itl"] == pytest.approx([0.2, 0.2, 0.2])
    assert lat["e2e"] == [0.5, 0.4]


def test_stage_summary():
    recs = [rec(10.0, 1.0, [0.2, 0.6, 1.0], 3), rec(10.5, 1.5, [0.4, 1.5], 5),
            rec(11.0, 0.01, [], 0, "RESOURCE_EXHAUSTED"), rec(11.5, 0.02, [], 0, "429"),
            rec(11.5, 0.02, [], 0, "429")]
    row = summarize(0, STAGE, recs, start=10.0)
    assert row["duration_s"] == 2.0                    # start 10.0 to the last completion, 12.0
    assert (row["sent"], row["ok"], row["failed"]) == (5, 2, 3)
    assert row["failures"] == {"429": 2, "RESOURCE_EXHAUSTED": 1}
    assert row["request_throughput"] == 1.0 and row["output_throughput"] == 4.0 and row["output_tokens"] == 8
    assert row["offered_rps"] == pytest.approx(5 / 1.5, abs=1e-3)
    assert row["ttft_p50_ms"] == pytest.approx(300.0) and row["ttft_p99_ms"] == pytest.approx(398.0)
    assert row["tpot_mean_ms"] == pytest.approx((400 + 275) / 2)
    assert row["itl_p50_ms"] == pytest.approx(400.0)   # gaps 400, 400, 1100 ms
    assert row["e2e_p90_ms"] == pytest.approx(1450.0)
    assert row["strategy"] == "(default)"


def test_empty_stage():
    row = summarize(3, STAGE, [], start=5.0)
    assert (row["sent"], row["ok"], row["request_throughput"], row["ttft_p99_ms"]) == (0, 0, 0.0, None)


def test_timeline_bins():
    recs = [rec(0.2, 0.5, [0.1], 2), rec(0.7, 1.0, [0.6], 2), rec(1.1, 0.1, [], 0, "429"),
            rec(2.5, 0.2, [0.1], 1)]
    rows = timeline(recs, [(0.5, 1), (1.9, None), (2.2, 2)], t0=0.0, t1=3.0, bin_s=1.0)
    assert [r["offered_rps"] for r in rows] == [2, 1, 1]
    assert [r["completed_rps"] for r in rows] == [1, 1, 1]       # ends at 0.7, 1.7, 2.7
    assert [r["failed_rps"] for r in rows] == [0, 1, 0]
    assert [r["ttft_p99_ms"] for r in rows] == [100.0, 600.0, 100.0]
    assert [r["replicas"] for r in rows] == [1, 1, 2]            # a failed (None) sample keeps the last one
    half = timeline(recs, [], t0=0.0, t1=3.0, bin_s=0.5)
    assert len(half) == 6 and half[0]["offered_rps"] == 2.0 and half[0]["replicas"] is None
    assert auto_bin(90) == 1.0 and auto_bin(600) == 5.0


def test_greedy_check_marks_mismatches():
    recs = [rec(0, 1, [0.1], 3, prompt=0, max_new_tokens=3, ignore_eos=True, greedy=True, token_ids=[1, 2, 3]),
            rec(0, 1, [0.1], 3, prompt=1, max_new_tokens=3, ignore_eos=True, greedy=True, token_ids=[1, 2, 4]),
            rec(0, 1, [0.1], 3, prompt=2, max_new_tokens=3, ignore_eos=True, greedy=True, token_ids=[9, 9, 9]),
            rec(0, 1, [0.1], 3, prompt=0, max_new_tokens=3, ignore_eos=True, greedy=False, token_ids=[7, 7, 7]),
            rec(0, 0, [], 0, "429", prompt=1, max_new_tokens=3, ignore_eos=True, greedy=True, token_ids=None)]
    expected = {(0, 3, True): [1, 2, 3], (1, 3, True): [1, 2, 3]}          # no reference for prompt 2
    assert check_greedy(recs, expected) == (2, 1)
    assert [r["status"] for r in recs] == ["OK", MISMATCH, "OK", "OK", "429"]
    assert recs[1]["status_before"] == "OK" and "differs" in recs[1]["error"]
