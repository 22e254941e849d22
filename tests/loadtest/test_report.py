"""From the worker's messages to the table, CSV, JSON and PNG files (no server, no locust)."""
from __future__ import annotations

import csv
import json
import sys

from cluster.loadtest.clients import Target
from cluster.loadtest.report import format_markdown, format_table, write_outputs
from cluster.loadtest.run import build_result, result_json
from cluster.loadtest.spec import LoadSpec, parse_stages

T0 = 1000.0          # the worker's clock (monotonic); the result is relative to the first stage's start


def req(stage, seq, start, e2e, chunks, out, status="OK", **kw):
    return {"t": "req", "stage": stage, "seq": seq, "prompt": seq % 2, "protocol": "grpc", "start": T0 + start,
            "e2e": e2e, "chunks": chunks, "out": out, "status": status, "error": "", "retry_after": None,
            "max_new_tokens": 4, "ignore_eos": True, "greedy": True, "token_ids": kw.get("tokens")}


def messages(locust_count_0=3):
    return [
        {"t": "stage", "stage": 0, "start": T0},
        req(0, 0, 0.0, 0.4, [0.1, 0.2, 0.4], 4, tokens=[1, 2, 3, 4]),
        req(0, 1, 0.1, 0.5, [0.2, 0.5], 4, tokens=[5, 6, 7, 8]),
        req(0, 2, 0.2, 0.01, [], 0, "RESOURCE_EXHAUSTED"),
        {"t": "stage_end", "stage": 0, "end": T0 + 1.0, "sent": 3, "delayed": 0,
         "locust": {"requests": locust_count_0, "failures": 1}},
        {"t": "stage", "stage": 1, "start": T0 + 1.0},
        req(1, 0, 1.0, 0.3, [0.1, 0.3], 4, tokens=[1, 2, 3, 4]),
        req(1, 1, 1.5, 0.02, [], 0, "429"),
        {"t": "stage_end", "stage": 1, "end": T0 + 2.2, "sent": 2, "delayed": 1,
         "locust": {"requests": 2, "failures": 1}},
        {"t": "done"},
    ]


SPEC = LoadSpec(parse_stages("c=2:1s,rate=2:1s:protocol=http"))


def test_result_and_files(tmp_path):
    expected = {(0, 4, True): [1, 2, 3, 4], (1, 4, True): [5, 6, 7, 0]}     # prompt 1's reference differs
    samples = [(T0 + 0.5, 1), (T0 + 1.5, 2)]
    res = build_result(SPEC, messages(), samples, expected)
    assert res.greedy == {"checked": 3, "mismatched": 1}
    assert res.failures == {"RESOURCE_EXHAUSTED": 1, "429": 1, "GREEDY_MISMATCH": 1} and res.failed == 3
    assert [r["ok"] for r in res.stages] == [1, 1] and res.stages[1]["delayed_arrivals"] == 1
    assert res.warnings == []
    assert res.replicas == [(0.5, 1), (1.5, 2)]
    assert [w["start_s"] for w in res.stage_windows] == [0.0, 1.0] and res.stage_windows[1]["end_s"] == 2.2
    assert [r["replicas"] for r in res.timeline] == [1, 2, 2]
    assert res.requests[3]["start"] == 1.0

    table = format_table(res.stages)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["stage", "load", "proto"] and "TTFT p50/p90/p99 ms" in lines[0]
    assert "c=2" in lines[2] and "2 (GREEDY_MISMATCH 1, RESOURCE_EXHAUSTED 1)" in lines[2]
    assert "rate=2/s" in lines[3] and "http" in lines[3] and "1 (429 1)" in lines[3]
    assert "| c=2 | grpc |" in format_markdown(res.stages)

    files = write_outputs(tmp_path, result_json(res, SPEC, Target(), 2))
    assert set(files) == {"json", "stages_csv", "requests_csv", "timeline_csv", "png"}
    data = json.loads(files["json"].read_text())
    assert data["failures"] == {"RESOURCE_EXHAUSTED": 1, "429": 1, "GREEDY_MISMATCH": 1}
    assert data["spec"]["stages"][1]["request"]["protocol"] == "http" and len(data["requests"]) == 5
    with files["stages_csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert [r["label"] for r in rows] == ["c=2", "rate=2/s"]
    assert rows[0]["ttft_p50_ms"] == "100.0"                           # the mismatch adds no latency
    assert json.loads(rows[0]["failures"]) == {"GREEDY_MISMATCH": 1, "RESOURCE_EXHAUSTED": 1}
    with files["requests_csv"].open() as f:
        reqs = list(csv.DictReader(f))
    assert len(reqs) == 5 and "token_ids" not in reqs[0] and reqs[1]["status"] == "GREEDY_MISMATCH"
    with files["timeline_csv"].open() as f:
        assert [r["t_s"] for r in csv.DictReader(f)] == ["0.0", "1.0", "2.0"]
    assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and files["png"].stat().st_size > 10_000


def test_counts_that_disagree_are_reported():
    res = build_result(SPEC, messages(locust_count_0=2))
    assert res.greedy == {} and res.failures == {"RESOURCE_EXHAUSTED": 1, "429": 1}
    assert res.warnings == ["stage 0: 3 records, 3 sent, locust counted 2"]
    assert all(r["replicas"] is None for r in res.timeline)


def test_report_code_needs_no_locust():
    assert "locust" not in sys.modules and "gevent" not in sys.modules
