"""The load test against a served cluster (configs/tiny.yaml, the session's ``served`` fixture): the CLI over
gRPC and HTTP with greedy outputs checked, and overload past ``max_batch + max_queue`` counted by status.

The load comes from a locust worker subprocess; this (pytest) process never imports locust.
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

from cluster.loadtest import (
    LoadSpec,
    RequestSpec,
    Target,
    parse_stages,
    run_loadtest,
    serve_replicas,
)

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n"]


def _target(cfg) -> Target:
    cl = cfg.cluster
    return Target(grpc=f"127.0.0.1:{cl.grpc_port}", http=f"http://127.0.0.1:{cl.http_port}", app=cl.app_name)


def test_cli_stages_over_grpc_and_http(served, tmp_path):
    cfg, _ = served
    t = _target(cfg)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "cluster.cli.main", "loadtest", "--config", "configs/tiny.yaml",
           "--grpc", t.grpc, "--http", t.http, "--app", t.app, "--prompts", "4",
           "--stages", "c=2:120s:max=6,rate=4:120s:max=6:protocol=http", "--max-new-tokens", "8", "--temperature", "0",
           "--ignore-eos", "--greedy-check", "--out", str(out), "--no-progress", "--fail-on-error"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]

    lines = p.stdout.splitlines()
    assert lines[0].split()[:4] == ["stage", "load", "proto", "strategy"]
    rows = {ln.split()[1]: ln.split() for ln in lines[2:4]}
    assert rows["c=2"][2] == "grpc" and rows["c=2"][5:8] == ["6", "6", "0"]            # sent, ok, failed
    assert rows["rate=4/s"][2] == "http" and rows["rate=4/s"][5:8] == ["6", "6", "0"]
    assert "greedy check: 12 requests checked, 0 mismatched" in p.stdout

    data = json.loads((out / "loadtest.json").read_text())
    assert data["failures"] == {} and data["greedy"] == {"checked": 12, "mismatched": 0} and data["warnings"] == []
    for r in data["requests"]:
        assert r["status"] == "OK" and r["out"] == 8, r
        assert 0 < r["chunks"][0] <= r["chunks"][-1] <= r["e2e"]           # streamed: TTFT, then the rest
    with (out / "loadtest_stages.csv").open() as f:
        stages = list(csv.DictReader(f))
    assert [(s["label"], s["protocol"], s["ok"], s["failed"]) for s in stages] == \
        [("c=2", "grpc", "6", "0"), ("rate=4/s", "http", "6", "0")]
    for s in stages:
        assert float(s["request_throughput"]) > 0 and float(s["output_throughput"]) > 0
        assert 0 < float(s["ttft_p50_ms"]) <= float(s["ttft_p99_ms"]) <= float(s["e2e_p99_ms"])
        assert float(s["tpot_p50_ms"]) > 0 and float(s["itl_p50_ms"]) > 0
    assert (out / "loadtest_timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "loadtest_timeline.csv").read_text().startswith("t_s,offered_rps,completed_rps")


def test_overload_is_refused_counted_and_bounded(served, tmp_path):
    cfg, _ = served
    cap = cfg.engine.max_batch + cfg.engine.max_queue                 # 4 + 4 in configs/tiny.yaml
    req = RequestSpec(max_new_tokens=32, temperature=0.0, ignore_eos=True, timeout_s=60)
    spec = LoadSpec(parse_stages(f"c={2 * cap}:2s,rate=40:2s:protocol=http", req))
    t0 = time.monotonic()
    res = run_loadtest(spec, PROMPTS, _target(cfg), out_dir=tmp_path, replicas=serve_replicas(cfg.cluster.app_name),
                       sample_s=0.5, progress=False)
    took = time.monotonic() - t0
    assert took < 90, took                                            # nothing hangs

    grpc_stage, http_stage = res.stages
    assert set(grpc_stage["failures"]) == {"RESOURCE_EXHAUSTED"} and grpc_stage["ok"] > 0, grpc_stage
    assert set(http_stage["failures"]) == {"429"} and http_stage["ok"] > 0, http_stage
    assert grpc_stage["sent"] >= 2 * cap                               # every client sent at least once
    refused = [r for r in res.requests if r["status"] != "OK"]
    assert all(r["e2e"] < 5.0 for r in refused)                       # refused at once, not queued
    assert all(r["retry_after"] == "1" for r in refused if r["status"] == "429")
    ok = [r for r in res.requests if r["status"] == "OK"]
    assert ok and max(r["e2e"] for r in ok) < 30.0 and all(r["out"] == 32 for r in ok)
    assert res.replicas and all(v == 1 for _, v in res.replicas)
    assert {r["replicas"] for r in res.timeline} == {1}
    assert res.warnings == [] and res.files["png"].is_file()
    assert "locust" not in sys.modules and "gevent" not in sys.modules


def test_chat_and_plain_openai_stages_against_the_local_cluster(served, tmp_path):
    """The same chat load with specserve's fields and as plain OpenAI requests (``openai: true``: what another
    server is sent), both answered by the local cluster: every request counted with its tokens."""
    cfg, _ = served
    t = _target(cfg)
    spec = tmp_path / "ab.yaml"
    spec.write_text(f"""
request: {{protocol: http, endpoint: chat, max_new_tokens: 6, temperature: 0, ignore_eos: true}}
stages:
  - {{c: 2, duration: 120s, max_requests: 4}}
  - {{c: 2, duration: 120s, max_requests: 4, request: {{openai: true, model: {cfg.cluster.app_name}}}}}
  - {{c: 2, duration: 120s, max_requests: 4, request: {{openai: true, model: {cfg.cluster.app_name}, stream: false}}}}
  - {{c: 1, duration: 120s, max_requests: 2, request: {{protocol: grpc}}}}
""")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "cluster.cli.main", "loadtest", "--config", "configs/tiny.yaml", "--grpc", t.grpc,
           "--http", t.http + "/v1", "--app", t.app, "--prompts", "4", "--spec", str(spec), "--out", str(out),
           "--no-progress", "--no-plot", "--fail-on-error"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    data = json.loads((out / "loadtest.json").read_text())
    assert data["failures"] == {}
    assert len(data["requests"]) == 14
    for r in data["requests"]:
        assert r["status"] == "OK" and r["out"] == 6, r
