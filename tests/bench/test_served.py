"""The served suite end to end on configs/tiny.yaml: it starts Ray and Serve itself (separated topology, free
ports), measures through gRPC at concurrency 1 and 2 and in-process at c = 1, writes the CSV/JSON/PNG, and
every greedy output equals autoregressive's, with no failed request."""
from __future__ import annotations

import argparse
import json

import pytest

from cluster.bench import SUITES, served
from cluster.config.schema import load_config
from cluster.family import ensure_built

NEW = 8
ROWS = ["autoregressive", "speculative", "cs_drafting"]


def test_served_suite_end_to_end(tmp_path, capsys):
    ray = pytest.importorskip("ray")
    assert SUITES["served"] is served.run
    was_up = ray.is_initialized()
    cfg = load_config("configs/tiny.yaml")
    ensure_built(cfg, progress=False)
    args = argparse.Namespace(prompts="3", max_new_tokens=str(NEW), temperature="0", out=str(tmp_path),
                              concurrency="1,2", requests_per_client="2", strategies=",".join(ROWS),
                              time_limit=None)
    res = served.collect(args, cfg)
    printed = capsys.readouterr().out

    assert ray.is_initialized() == was_up                 # what it started, it shut down
    for ext in ("csv", "json", "png"):
        assert (tmp_path / f"bench_served.{ext}").stat().st_size > 0
    rows = json.loads((tmp_path / "bench_served.json").read_text())
    assert rows == res.table
    assert sorted((r["strategy"], r["concurrency"]) for r in rows) == sorted((s, c) for s in ROWS for c in (1, 2))
    for r in rows:
        assert r["failures"] == 0, r
        assert r["mismatches"] == 0, r
        assert r["requests"] == 2 * r["concurrency"]
        assert r["tokens"] == r["requests"] * NEW, r
        assert r["tok_s"] > 0 and r["ttft_p50"] > 0 and r["tpot_p99"] >= r["tpot_p50"] >= 0, r
        if r["concurrency"] == 1:
            assert r["in_process_tok_s"] > 0 and r["cluster_vs_in_process"] > 0, r
        if r["strategy"] == "autoregressive":
            assert r["vs_autoregressive"] == 1.0
    assert res.mismatches == []
    assert ("in-process", "cs_drafting", 1) in res.cells
    assert "lossless (greedy)" in printed and "MISMATCH" not in printed
