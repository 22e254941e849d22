"""The served suite end to end on configs/tiny.yaml, run as a user runs it (`specserve bench --suite served`, its
own process: it starts Ray and Serve itself, every topology in turn, free ports, and a Serve already running in
this test session's Ray would otherwise be joined): measures through gRPC, unary and streamed, at concurrency 1
and 2 and in-process at c = 1 beside each topology, writes the CSV/JSON/PNG, the side-by-side summary and the
production-70b projection, and every greedy output equals autoregressive's, with no failed request."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.bench import SUITES, served, served_cells

ROOT = Path(__file__).resolve().parents[2]

NEW = 8
ROWS = ["autoregressive", "speculative", "cs_drafting"]
TOPOLOGIES = ("separated", "colocated", "speculator")


@pytest.mark.slow      # ~75 s (the default run's 15 minutes); the suite's parts are tested one by one here
def test_served_suite_end_to_end(tmp_path):
    assert SUITES["served"] is served.run
    cmd = [sys.executable, "-m", "cluster.cli.main", "bench", "--config", "configs/tiny.yaml", "--suite", "served",
           "--prompts", "3", "--max-new-tokens", str(NEW), "--out", str(tmp_path), "--concurrency", "1,2",
           "--requests-per-client", "2", "--strategies", ",".join(ROWS)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    printed = p.stdout
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for ext in ("csv", "json", "png"):
        assert (tmp_path / f"bench_served.{ext}").stat().st_size > 0
    rows = json.loads((tmp_path / "bench_served.json").read_text())
    cells = [(t, m, s, c) for t in TOPOLOGIES for m in ("unary", "streamed") for s in ROWS
             for c in (1, 2)]
    assert sorted((r["topology"], r["mode"], r["strategy"], r["concurrency"]) for r in rows) == sorted(cells)
    for r in rows:
        assert r["failures"] == 0, r
        assert r["mismatches"] == 0, r
        assert r["requests"] == 2 * r["concurrency"]
        assert r["tokens"] == r["requests"] * NEW, r
        assert r["tok_s"] > 0
        if r["mode"] == "streamed":
            assert r["ttft_p50"] > 0 and r["tpot_p99"] >= r["tpot_p50"] >= 0, r
            assert r["streamed_vs_unary"] > 0, r
        else:
            assert r["ttft_p50"] is None and r["streamed_vs_unary"] is None, r
        if r["concurrency"] == 1:
            assert r["in_process_tok_s"] > 0 and r["cluster_vs_in_process"] > 0, r
        if r["strategy"] == "autoregressive":
            assert r["vs_autoregressive"] == 1.0
        if r["topology"] == "separated" and r["strategy"] != "autoregressive":   # the draft call's hops
            assert r["draft_calls"] > 0 and r["disordered"] == 0, r
            assert r["draft_ms"] >= r["compute_ms"] > 0 and r["request_hop_ms"] > 0 and r["reply_hop_ms"] > 0, r
        if r["topology"] == "colocated":
            assert r.get("draft_calls") is None, r
        if r["topology"] == "speculator" and r["strategy"] != "autoregressive":   # the speculation cache's columns
            assert r["cache_steps"] > 0 and 0 <= r["cache_hit_share"] <= 1 and r["draft_ms"] > 0, r
            assert abs(r["hit_bonus"] + r["hit_reject"] + r["hit_known"] - r["cache_hit_share"]) < 0.003, r
    summary = json.loads((tmp_path / "bench_served_summary.json").read_text())
    assert [(s["topology"], s["c"]) for s in summary] == [(t, c) for t in TOPOLOGIES for c in (1, 2)]
    for s in summary:
        assert s["ar_streamed/unary"] > 0 and s["ar_unary_tok_s"] > 0
        assert all(len(s[name].split(" / ")) == 2 for name in ROWS[1:])
    served_outputs = sum(r["requests"] for r in rows)
    in_process = len(TOPOLOGIES) * len(ROWS) * 2           # each c = 1 row in-process beside each topology's cells
    assert f"lossless (greedy): {served_outputs + in_process}/{served_outputs + in_process} outputs" in printed
    assert "MISMATCH" not in printed
    assert "projection for configs/production-70b.yaml" in printed


class _Client:
    """A unary client that logs each request it answers (one token: the prompt's first id)."""

    def __init__(self, log):
        self.log = log

    def generate(self, prompt_ids, seed, **_):
        self.log.append(("served", seed))
        return type("Result", (), {"token_ids": [prompt_ids[0]]})()


def test_paired_cell_alternates_served_and_in_process_requests():
    """``after`` runs each request's in-process twin before the next served request, and the cell's seconds are
    then the requests' own, summed (not first submit to last end, which would count the in-process time)."""
    log = []
    prompts = [[7], [8], [9]]
    recs, secs = served_cells.served_cell(_Client(log), prompts, 4, 1, 1, "autoregressive", {}, stream=False,
                                          after=lambda j: log.append(("in-process", j)))
    assert log == [(kind, j) for j in range(4) for kind in ("served", "in-process")]
    assert [r.token_ids for r in recs] == [[7], [8], [9], [7]]
    assert secs == sum(r.last - r.submit for r in recs) <= recs[-1].last - recs[0].submit
    with pytest.raises(ValueError, match="c must be 1"):
        served_cells.served_cell(_Client(log), prompts, 4, 2, 1, "autoregressive", {}, stream=False,
                                 after=lambda j: None)


def test_topology_verdict_names_the_fastest_default_row_against_autos_pick():
    """Per mode and c: the default row's tok/s in each topology, the fastest and its lead over auto's pick; the
    other strategies' rows do not count, and with only auto's pick measured there is nothing to judge."""
    from cluster.bench.served_report import topology_verdict

    def row(topology, mode, c, tok_s, strategy="default"):
        return {"topology": topology, "mode": mode, "concurrency": c, "strategy": strategy, "tok_s": tok_s}

    table = [row("colocated", "unary", 1, 50.0), row("speculator", "unary", 1, 40.0),
             row("colocated", "unary", 4, 90.0), row("speculator", "unary", 4, 99.0),
             row("colocated", "unary", 1, 500.0, "mag")]
    verdict = topology_verdict(table, ["colocated", "speculator"], "speculator")
    assert [(v["c"], v["fastest"], v["fastest_vs_auto"]) for v in verdict] == [(1, "colocated", 1.25),
                                                                             (4, "speculator", 1.0)]
    assert verdict[0]["colocated_tok_s"] == 50.0 and verdict[0]["auto"] == "speculator"
    assert topology_verdict(table, ["speculator"], "speculator") == []
