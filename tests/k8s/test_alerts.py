"""Issue 23, point 4: the alert rules of k8s/prometheusrule.yaml, unit-tested with ``promtool test rules``
(tests/k8s/alerts_test.yaml: each alert fires on a cluster breaking its SLO, not before its ``for``, and not on
one inside it), and held to the series specserve exports."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from cluster.serving.ops.metrics import EXPORTED
from tests.k8s.validators import ROOT, load_docs

(RULE,) = [d for d in load_docs(ROOT / "k8s" / "prometheusrule.yaml") if d["kind"] == "PrometheusRule"]
CASES = ROOT / "tests" / "k8s" / "alerts_test.yaml"
ALERTS = {"SpecServeHighErrorRatio", "SpecServeTTFTAboveSLO", "SpecServeITLAboveSLO", "SpecServeAcceptanceCollapsed",
          "SpecServeModelDown", "SpecServeQueueSaturated"}


def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None and os.environ.get("SPECSERVE_REQUIRE_PROMTOOL"):
        pytest.fail("promtool is required here (SPECSERVE_REQUIRE_PROMTOOL, set by .ci/run): apt-get install prometheus")
    if exe is None:
        pytest.skip("promtool is not installed (Debian/Ubuntu package `prometheus`: apt-get install prometheus; "
                    ".ci/run installs it)")
    return exe


def _rules_dir(tmp_path, groups=None):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups or RULE["spec"]["groups"]}))
    shutil.copy(CASES, tmp_path / CASES.name)
    return tmp_path


def test_every_issue_23_alert_exists_and_has_a_promtool_case():
    rules = [r for g in RULE["spec"]["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules if "alert" in r} == ALERTS
    tested = {t["alertname"] for case in yaml.safe_load(CASES.read_text())["tests"] for t in case["alert_rule_test"]}
    assert tested == ALERTS


def test_the_rules_query_only_exported_series():
    exported = {n + part for n, kind in EXPORTED.items()
                for part in (("_bucket", "_sum", "_count") if kind == "histogram" else ("",))}
    recorded = {r["record"] for g in RULE["spec"]["groups"] for r in g["rules"] if "record" in r}
    for group in RULE["spec"]["groups"]:
        for rule in group["rules"]:
            names = set(re.findall(r"\bray_[A-Za-z0-9_]+", str(rule["expr"]))) - {"ray_io_cluster"}
            assert names <= exported, (rule.get("alert") or rule.get("record"), names - exported)
            assert set(re.findall(r"\bspecserve:[a-z0-9_:]+", str(rule["expr"]))) <= recorded


def test_promtool_checks_and_unit_tests_the_rules(tmp_path):
    exe = _promtool()
    d = _rules_dir(tmp_path)
    check = subprocess.run([exe, "check", "rules", str(d / "rules.yaml")], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    run = subprocess.run([exe, "test", "rules", CASES.name], capture_output=True, text=True, timeout=120, cwd=d)
    assert run.returncode == 0, run.stdout + run.stderr


def test_promtool_fails_the_cases_when_an_slo_is_loosened(tmp_path):
    """The cases hold the thresholds: with a p99 TTFT SLO of 10 s the TTFT alert no longer fires."""
    exe = _promtool()
    groups = yaml.safe_load(yaml.safe_dump(RULE["spec"]["groups"]))
    (slo,) = [r for r in groups[0]["rules"] if r.get("record") == "specserve:slo:ttft_p99_seconds"]
    slo["expr"] = "vector(10)"
    d = _rules_dir(tmp_path, groups)
    run = subprocess.run([exe, "test", "rules", CASES.name], capture_output=True, text=True, timeout=120, cwd=d)
    assert run.returncode != 0 and "SpecServeTTFTAboveSLO" in run.stdout + run.stderr
