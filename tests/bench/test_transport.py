"""The transport suite's measuring loop, driven in-process (the Ray transports run in `--suite transport`), and its
table of the draft call's hops in a real separated unit per channel (local Ray, configs/tiny.yaml)."""
import os
from types import SimpleNamespace

import pytest

from cluster.bench.hops import unit_hops
from cluster.bench.report import HOP_COLUMNS
from cluster.bench.transport import PAYLOADS, Echo, _cpu_seconds, _measure
from cluster.config.schema import load_config


def test_measure_reports_round_trips_and_cpu_of_both_sides():
    echo = Echo()
    sent = []

    def send(args):
        sent.append(args)
        return echo.call(args)

    row = _measure(send, os.getpid(), n=5)
    for label in PAYLOADS:
        assert 0 < row[f"{label} p50 ms"] <= row[f"{label} p90 ms"]
    assert {len(p) for p, s in sent if s == 0} == set(PAYLOADS.values())
    assert sum(1 for _, s in sent if s > 0) == 10                      # the waiting phase: 10 calls of 20 ms
    assert 0 <= row["idle: caller CPU s/s"] < 0.5                      # sleeping, not polling
    assert row["waiting: caller CPU s/s"] < 0.5                        # time.sleep in this process: no CPU


def test_cpu_seconds_grows_with_work():
    before = _cpu_seconds(os.getpid())
    x = 0
    for i in range(3_000_000):
        x += i
    assert _cpu_seconds(os.getpid()) > before


def test_draft_hops_per_channel_against_in_process():
    """One row per strategy and runtime, outputs equal autoregressive's, every hop on the one host clock."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, namespace="specserve-test", log_to_driver=False)
    cfg = load_config("configs/tiny.yaml")
    rows = unit_hops(SimpleNamespace(prompts=1, max_new_tokens=12, channels="ray,socket"), cfg)
    assert [(r["strategy"], r["runtime"]) for r in rows] == [
        (s, rt) for s in ("default", "cs_drafting")
        for rt in ("in-process", "separated/ray", "separated/socket", "speculator", "speculator/in-time")]
    for r in rows:
        assert r["mismatches"] == 0, r
        if r["runtime"].startswith("speculator"):      # the speculation cache's columns instead of hops
            assert r["cache_steps"] > 0 and r["draft_ms"] > 0 and 0 <= r["late_share"] <= 1, r
            if r["runtime"] == "speculator/in-time":   # every answer in time: no late step, no speed column
                assert r["late_share"] == 0 and r["tok_s"] is None, r
            continue
        assert r["tok_s"] > 0 and r["draft_calls"] > 0, r
        if r["runtime"] == "in-process":
            assert r["draft_ms"] == r["compute_ms"] and r["request_hop_ms"] is None, r
        else:
            assert set(HOP_COLUMNS) <= set(r) and r["disordered"] == 0, r
            assert r["request_hop_ms"] > 0 and r["reply_hop_ms"] > 0 and r["actor_ms"] >= r["compute_ms"], r
