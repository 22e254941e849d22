"""Metrics as Prometheus scrapes them from Ray's metrics export port, and the Grafana dashboard against them.

Requests go through the served cluster's real gRPC and HTTP ports (speculative, cascades, a 400 on each
front, an HTTP 404 for an unknown model, a stream); then Ray's exporter is polled (it exports with a delay)
until every series of cluster.serving.ops.metrics.EXPORTED is there with our labels.  Every metric a dashboard
panel or variable queries must be in that scrape, and every label it selects or groups by must be on it.
"""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

import grpc
import pytest

from cluster.serving.ops.metrics import EXPORTED
from tests.support.polling import poll

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "k8s" / "grafana" / "specserve-dashboard.json"
HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")


def _scrape(port: int) -> dict[str, list[dict]]:
    """{sample name: [labels of each series]} from Ray's Prometheus endpoint (its own parser for the text)."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, list[dict]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append({**s.labels, "__value__": s.value})
    return out


def _total(samples, name, **labels) -> float:
    return sum(s["__value__"] for s in samples.get(name, ()) if all(s.get(k) == v for k, v in labels.items()))


def _http(cfg, body: dict) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{cfg.cluster.http_port}/v1/completions",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) > 20
    return exprs


def _names(expr: str) -> set[str]:
    return set(re.findall(r"\bray_[A-Za-z0-9_]+", expr)) - {"ray_io_cluster"}     # a label, not a metric


def _selector_labels(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, label names in its {...} selector) for each selector in ``expr``."""
    return [(m, set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", sel))) for m, sel in re.findall(r"(ray_\w+)\{([^}]*)\}", expr)]


def _grouping_labels(expr: str) -> set[str]:
    return {lab.strip() for group in re.findall(r"\bby\s*\(([^)]*)\)", expr) for lab in group.split(",") if lab.strip()}


def test_dashboard_queries_name_only_our_metrics():
    """Without a cluster: every name the dashboard queries is one specserve exports (EXPORTED)."""
    exported = {n + part for n, kind in EXPORTED.items() for part in (HISTOGRAM_PARTS if kind == "histogram" else ("",))}
    for expr in _dashboard_queries():
        assert _names(expr) and _names(expr) <= exported, (expr, _names(expr) - exported)
    panels = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    for title in ("Acceptance rate", "Mean accepted length", "Acceptance by draft position", "Draft tokens / s",
                  "Cascade deferral rate", "Time to first token", "Running and waiting requests",
                  "Inter-token latency", "Request phases (mean)", "KV cache usage"):
        assert title in panels
    variables = {v["name"] for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert {"cluster", "session"} <= variables
    for expr in _dashboard_queries():          # every series query filters by cluster and session
        for metric, selected in _selector_labels(expr):
            assert {"ray_io_cluster", "SessionName"} <= selected or expr.startswith("label_values"), (metric, expr)


def test_scrape_has_every_metric_with_labels_and_the_dashboard_matches(served):
    ray = pytest.importorskip("ray")
    cfg, c = served
    model = cfg.cluster.app_name
    # gRPC: speculative (per-position acceptance), two cascades (deferrals), one refused
    c.generate(prompt="def main():", max_new_tokens=12, temperature=0.0, seed=1, strategy="speculative",
               options={"k": 3})
    for _ in range(2):                         # a long prompt twice: the second finds it in the prefix cache
        c.generate(prompt="def main():\n    " + "x = 1\n    " * 12, max_new_tokens=2, temperature=0.0)
    for strategy in ("spec_cascade", "token_cascade"):
        c.generate(prompt="import os", max_new_tokens=8, temperature=1.0, seed=2, strategy=strategy)
    with pytest.raises(grpc.RpcError) as e:
        c.generate(prompt="x", max_new_tokens=2, temperature=-1.0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # HTTP: a completion, a stream, a 400 and a 404
    assert _http(cfg, {"prompt": "def f():", "max_tokens": 6, "strategy": "speculative", "model": model}) == 200
    assert _http(cfg, {"prompt": "def f():", "max_tokens": 6, "stream": True}) == 200
    assert _http(cfg, {"prompt": "x", "max_tokens": 2, "top_p": 7}) == 400
    assert _http(cfg, {"prompt": "x", "max_tokens": 2, "model": "no-such-model"}) == 404

    port = ray._private.worker.global_worker.node.metrics_export_port
    wanted = {n + ("_bucket" if kind == "histogram" else "") for n, kind in EXPORTED.items()}

    missing: list[str] = []

    def exported():
        s = _scrape(port)
        missing[:] = [n for n in sorted(wanted) if not any(x.get("model_name") == model for x in s.get(n, ()))]
        missing.extend(what for what, ok in (
            ("2 invalid", _total(s, "ray_specserve_requests_total", outcome="invalid") >= 2),
            ("1 not_found", _total(s, "ray_specserve_requests_total", outcome="not_found") >= 1),
            ("accepted per position", _total(s, "ray_vllm_spec_decode_num_accepted_tokens_per_pos_total",
                                             strategy="speculative") > 0),
            ("token_cascade checks", _total(s, "ray_specserve_cascade_deferral_checks_total",
                                            strategy="token_cascade") > 0),
            ("spec_cascade checks", _total(s, "ray_specserve_cascade_deferral_checks_total",
                                           strategy="spec_cascade") > 0)) if not ok)
        return None if missing else s
    try:
        samples = poll(exported, "Ray's exporter to show every metric and the requests above", timeout=180)
    except AssertionError as e:
        raise AssertionError(f"{e}; still missing: {missing}") from None

    for name in wanted:                                  # Serve's metrics API adds the replica's labels
        assert any(x.get("model_name") == model and x.get("deployment") == "SpecServe" and x.get("replica")
                   and x.get("application") == model and x.get("WorkerId") for x in samples[name]), \
            (name, samples[name][:2])
    assert {s["position"] for s in samples["ray_vllm_spec_decode_num_accepted_tokens_per_pos_total"]} >= {"0"}
    assert _total(samples, "ray_vllm_request_success_total", finished_reason="length") > 0
    assert _total(samples, "ray_vllm_spec_decode_num_draft_tokens_total", strategy="speculative") >= \
        _total(samples, "ray_vllm_spec_decode_num_accepted_tokens_total", strategy="speculative") > 0

    for expr in _dashboard_queries():
        names = _names(expr)
        missing = names - set(samples)
        assert not missing, f"dashboard query names metrics the server does not export: {missing}\n{expr}"
        labels = {k for n in names for s in samples[n] for k in s}
        for metric, selected in _selector_labels(expr):     # ray_io_cluster: the PodMonitor's relabeling adds it
            have = {k for s in samples[metric] for k in s}
            assert selected - {"ray_io_cluster"} <= have, (metric, selected - have, expr)
        assert _grouping_labels(expr) <= labels | {"le"}, (_grouping_labels(expr) - labels, expr)
    _ray_serve_llm_dashboard_panels_have_data(samples)


# Ray Serve LLM's dashboard (shipped with Ray) panels that specserve's metrics fill; its prefix-cache, Swapped,
# NIXL and KV-offload panels chart vLLM internals specserve does not have.
RAY_SERVE_LLM_ROWS = {"Throughput", "Latency", "Request Length", "Token Distribution"}
RAY_SERVE_LLM_SCHEDULER = {"Scheduler: Running", "Scheduler: Waiting", "Finish Reason", "Cache Utilization",
                           "Queue Time", "Prefill Time", "Decode Time"}


def _ray_serve_llm_dashboard_panels_have_data(samples) -> None:
    from ray.dashboard.modules.metrics.dashboards.serve_llm_dashboard_panels import (
        serve_llm_dashboard_config,
    )
    checked = 0
    for row in serve_llm_dashboard_config.rows:
        for panel in row.panels:
            if row.title not in RAY_SERVE_LLM_ROWS and panel.title not in RAY_SERVE_LLM_SCHEDULER:
                continue
            for target in panel.targets:
                for name in _names(target.expr):
                    assert name in samples, (row.title, panel.title, name)
                for metric, selected in _selector_labels(target.expr):     # model_name, WorkerId
                    if not metric.startswith("ray_vllm_"):
                        continue                  # Serve's own series, joined on WorkerId
                    have = {k for s in samples[metric] for k in s}
                    assert selected - {"ray_io_cluster"} <= have, (panel.title, metric, selected - have)
                checked += 1
    assert checked >= 34, checked


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, ConnectionError):
        return None


def test_dashboard_queries_evaluate_in_prometheus(served, tmp_path):
    """With a Prometheus server on the machine (Debian: ``apt-get install prometheus``): it scrapes the test
    cluster, and every dashboard query, with the Grafana variables set to All, evaluates to a non-empty
    result; every variable's label_values query finds our model."""
    import shutil
    import subprocess
    import urllib.parse
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (apt-get install prometheus)")
    ray = pytest.importorskip("ray")
    cfg, c = served
    c.generate(prompt="def g():", max_new_tokens=6, temperature=0.0, seed=4, strategy="speculative")
    port, web = ray._private.worker.global_worker.node.metrics_export_port, _free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: ray, static_configs: [{{targets: ['127.0.0.1:{port}'], "
        "labels: {ray_io_cluster: test}}]}]\n")           # what k8s/monitoring.yaml's relabeling adds
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{web}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{web}/api/v1"
    try:
        def query(expr):
            out = _get_json(f"{api}/query?query={urllib.parse.quote(expr)}")
            return out["data"]["result"] if out and out["status"] == "success" and out["data"]["result"] else None
        poll(lambda: query("ray_specserve_requests_total"), "Prometheus to scrape the cluster", timeout=120)
        dash = json.loads(DASHBOARD.read_text())
        for panel in dash["panels"]:
            for target in panel.get("targets", ()):
                expr = target["expr"].replace("$__rate_interval", "1m")
                for var in ("cluster", "session", "model_name", "strategy", "replica"):
                    expr = expr.replace(f"${var}", ".*")
                poll(lambda: query(expr), f"a result for {panel['title']}: {expr}", timeout=60)
        for var in dash["templating"]["list"]:
            if var["type"] != "query":
                continue
            metric_sel, label = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"]).groups()
            for name in ("cluster", "session", "model_name"):
                metric_sel = metric_sel.replace(f"${name}", ".*")
            sel = urllib.parse.quote(metric_sel)
            values = _get_json(f"{api}/label/{label}/values?match[]={sel}")["data"]
            assert values and (label != "model_name" or cfg.cluster.app_name in values), (var["name"], values)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
