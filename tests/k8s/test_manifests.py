"""Every manifest in k8s/ against the KubeRay CRD schemas (tests/k8s/crds/, unknown fields rejected), the
Kubernetes schemas (kubernetes-validate) and the rules a RayService must follow beyond them; and
each validator rejecting a broken manifest. No cluster is needed (docs/operator-guide.md, "Kubernetes (KubeRay)")."""
from __future__ import annotations

import copy

import pytest

from tests.k8s import rules
from tests.k8s.validators import (
    ROOT,
    crd_errors,
    k8s_errors,
    load_docs,
    manifest_errors,
    podmonitor_errors,
    ray_pod_templates,
    rayservice_core_errors,
)

# Ray's own Serve config models use pydantic-1-style Field(...) arguments: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MANIFESTS = sorted((ROOT / "k8s").glob("*.yaml"))
DOCS = [(f"{p.name}#{i}", doc) for p in MANIFESTS for i, doc in enumerate(load_docs(p))]
RAYSERVICES = {p.name: d for p in MANIFESTS for d in load_docs(p) if d["kind"] == "RayService"}

# What issue 12 asks of each RayService beyond a valid schema.
EXPECT = {
    "rayservice-production-70b.yaml": {"autoscaling": True, "gcs_ft": True, "gpu": True, "key_required": True},
    "rayservice-cpu.yaml": {"autoscaling": False, "gcs_ft": False, "gpu": False, "key_required": False},
}


def _cfg(doc):
    return rules.deployed_config(doc)


def _worker(doc, i=0):
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][i]


def _mutated(doc, change):
    doc = copy.deepcopy(doc)
    change(doc)
    return doc


def test_manifests_exist():
    assert set(RAYSERVICES) == set(EXPECT), "every RayService in k8s/ needs its EXPECT entry"
    assert {d["kind"] for _, d in DOCS} >= {"RayService", "PodMonitor", "PrometheusRule", "NetworkPolicy", "Gateway",
                                         "HTTPRoute", "GRPCRoute", "Certificate"}
    assert "Ingress" not in {d["kind"] for _, d in DOCS}      # ingress-nginx is end of life: the Gateway API


@pytest.mark.parametrize("name,doc", DOCS, ids=[n for n, _ in DOCS])
def test_manifest_validates(name, doc):
    assert manifest_errors(doc) == []


# -- the validators reject what the API server (strict field validation) would ---------------------------
def _container(doc):
    return _worker(doc)["template"]["spec"]["containers"][0]


CRD_BREAKAGES = {
    "unknown spec field": (lambda d: d["spec"].__setitem__("serveConfigV3", ""), "serveConfigV3"),
    "typo in rayClusterConfig": (lambda d: d["spec"]["rayClusterConfig"].__setitem__("enableInTreeAutoscalng", True),
                                 "enableInTreeAutoscalng"),
    "typo in an embedded container": (lambda d: _container(d).__setitem__("readinesProbe", {}), "readinesProbe"),
    "field the CRD's template metadata lacks": (
        lambda d: _worker(d)["template"]["metadata"].__setitem__("generateName", "x-"), "generateName"),
    "duplicate env name": (lambda d: _container(d)["env"].append(dict(_container(d)["env"][0])), "duplicate"),
    "duplicate container port": (lambda d: _container(d)["ports"].append({"containerPort": 8000, "name": "x"}),
                                 "duplicate"),
    "wrong type": (lambda d: _worker(d).__setitem__("replicas", "one"), "not of type 'integer'"),
    "missing required groupName": (lambda d: _worker(d).pop("groupName"), "groupName"),
}


@pytest.mark.parametrize("breakage", CRD_BREAKAGES)
def test_crd_validator_rejects(breakage):
    change, words = CRD_BREAKAGES[breakage]
    errors = crd_errors(_mutated(RAYSERVICES["rayservice-cpu.yaml"], change))
    assert errors and any(words in e for e in errors), errors


def test_kubernetes_validator_rejects_embedded_objects():
    doc = RAYSERVICES["rayservice-cpu.yaml"]
    bad_container = _mutated(doc, lambda d: _container(d).__setitem__("imagePullPolicyy", "Always"))
    assert any("imagePullPolicyy" in e and "cpu pod template" in e for e in rayservice_core_errors(bad_container))
    no_name = _mutated(doc, lambda d: _container(d).pop("name"))
    assert any("'name' is a required property" in e for e in rayservice_core_errors(no_name))
    bad_port = _mutated(doc, lambda d: d["spec"]["serveService"]["spec"]["ports"][0].__setitem__("prot", 1))
    assert any("serveService" in e and "prot" in e for e in rayservice_core_errors(bad_port))
    bad_meta = _mutated(doc, lambda d: d["metadata"].__setitem__("labelz", {}))
    assert any("labelz" in e for e in rayservice_core_errors(bad_meta))


def test_kubernetes_validator_rejects_core_objects():
    policy = next(d for _, d in DOCS if d["kind"] == "NetworkPolicy")
    broken = _mutated(policy, lambda d: d["spec"]["ingress"][1]["ports"][0].__setitem__("prot", 8000))
    assert any("prot" in e for e in k8s_errors(broken))
    no_selector = _mutated(policy, lambda d: d["spec"].pop("podSelector"))
    assert any("podSelector" in e for e in k8s_errors(no_selector))


def test_podmonitor_validator_rejects():
    pm = next(d for _, d in DOCS if d["kind"] == "PodMonitor")
    assert podmonitor_errors(pm) == []
    for change, words in [
        (lambda d: d["spec"].__setitem__("podMetricEndpoints", []), "podMetricEndpoints"),
        (lambda d: d["spec"]["podMetricsEndpoints"][0].__setitem__("interval", "15 seconds"), "15 seconds"),
        (lambda d: d["spec"]["podMetricsEndpoints"][0]["relabelings"][0].__setitem__("action", "rename"), "rename"),
        (lambda d: d["metadata"].__setitem__("nam", "x"), "nam"),
    ]:
        errors = podmonitor_errors(_mutated(pm, change))
        assert any(words in e for e in errors), errors


# -- what the manifests must get right beyond the schemas ----------------------------------------------------
@pytest.mark.parametrize("name", sorted(EXPECT))
def test_rayservice_rules(name):
    doc = RAYSERVICES[name]
    cfg = _cfg(doc)
    assert rules.serve_problems(doc, cfg) == []
    assert rules.placement_problems(doc, cfg) == []
    assert rules.probe_problems(doc, cfg) == []
    assert rules.node_problems(doc) == []
    assert rules.capacity_problems(doc, cfg) == []
    assert rules.gpu_problems(doc, cfg) == []
    assert rules.shm_problems(doc, cfg) == []


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_rayservice_has_what_issue_12_asks(name):
    doc, want = RAYSERVICES[name], EXPECT[name]
    spec, rc = RAYSERVICES[name]["spec"], RAYSERVICES[name]["spec"]["rayClusterConfig"]
    assert spec["upgradeStrategy"]["type"] in ("NewCluster", "NewClusterWithIncrementalUpgrade", "None")
    auto = _cfg(doc).cluster.autoscaling
    if want["autoscaling"]:
        assert rc["enableInTreeAutoscaling"] is True and auto is not None
        serve_max = auto.max_units
        for g in rc["workerGroupSpecs"]:          # a unit needs one pod of each group
            assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"] and g["maxReplicas"] >= serve_max
    if want["gcs_ft"]:
        ft = rc["gcsFaultToleranceOptions"]
        assert ft["redisAddress"] and "secretKeyRef" in ft["redisPassword"]["valueFrom"]
    for group, template in ray_pod_templates(doc):
        c = template["spec"]["containers"][0]
        if float(c["resources"]["limits"].get("nvidia.com/gpu", 0)) > 0:
            tol = template["spec"].get("tolerations", [])
            assert any(t["key"] == "nvidia.com/gpu" for t in tol) and template["spec"].get("nodeSelector"), group
        elif want["gpu"] is False:
            assert "nvidia.com/gpu" not in str(template)
    key = {e["name"]: e for e in rules.ray_container(rules.coordinator_hosts(doc)[0][1])["env"]}["SPECSERVE_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"].get("optional", False) is (not want["key_required"])


RULE_BREAKAGES = {
    "HeadOnly proxies": (lambda d: d["spec"].__setitem__("serveConfigV2", d["spec"]["serveConfigV2"].replace(
        "proxy_location: EveryNode", "proxy_location: HeadOnly")), rules.serve_problems, "proxy_location HeadOnly"),
    "head with CPUs and no /models": (
        lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", "8"),
        rules.placement_problems, "head: may host the coordinator but does not mount /models/"),
    "worker without the models volume": (lambda d: _container(d).pop("volumeMounts"), rules.placement_problems,
                                         "does not mount /models/"),
    "worker without the API key": (lambda d: _container(d).__setitem__("env", _container(d)["env"][:1]),
                                   rules.placement_problems, "no SPECSERVE_API_KEY"),
    "liveness on warm-up": (lambda d: _container(d).__setitem__("livenessProbe", _container(d)["readinessProbe"]),
                            rules.probe_problems, "livenessProbe is not GET /api/healthz"),
    "readiness on the proxy only": (lambda d: _container(d)["readinessProbe"]["httpGet"].__setitem__("path", "/-/healthz"),
                                    rules.probe_problems, "readinessProbe is not GET /health"),
    "head in the serve Service": (lambda d: d["spec"].pop("excludeHeadPodFromServeSvc"), rules.probe_problems,
                                  "excludeHeadPodFromServeSvc"),
    "dead threshold field": (lambda d: d["spec"].__setitem__("serviceUnhealthySecondThreshold", 900),
                             rules.serve_problems, "no longer has any effect"),
    "gRPC size limit missing": (lambda d: _container(d)["env"].pop(0), rules.node_problems,
                                "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"),
    "other Ray version": (lambda d: d["spec"]["rayClusterConfig"].__setitem__("rayVersion", "2.9.0"),
                          rules.node_problems, "rayVersion 2.9.0"),
    "drafter pod too small": (lambda d: _worker(d, 1)["template"]["spec"]["containers"][0]["resources"]["limits"]
                              .__setitem__("nvidia.com/gpu", "0"), rules.capacity_problems, "fits no pod"),
    "drafter pod with an idle GPU": (lambda d: _worker(d, 1)["template"]["spec"]["containers"][0]["resources"]["limits"]
                                     .__setitem__("nvidia.com/gpu", "2"), rules.gpu_problems,
                                     "drafters: asks for 2 GPUs, its roles ['drafters'] ask Ray for 1"),
    "TP pod short of GPUs": (lambda d: _worker(d, 0)["template"]["spec"]["containers"][0]["resources"]["limits"]
                             .__setitem__("nvidia.com/gpu", "4"), rules.gpu_problems, "target-tp8: asks for 4 GPUs"),
    "TP pod without /dev/shm": (lambda d: _worker(d, 0)["template"]["spec"]["volumes"].pop(), rules.shm_problems,
                                "without a memory-backed /dev/shm"),
    "TP pod with a disk /dev/shm": (lambda d: _worker(d, 0)["template"]["spec"]["volumes"][-1]["emptyDir"].pop("medium"),
                                    rules.shm_problems, "without a memory-backed /dev/shm"),
}


@pytest.mark.parametrize("breakage", RULE_BREAKAGES)
def test_rules_reject(breakage):
    change, check, words = RULE_BREAKAGES[breakage]
    doc = _mutated(RAYSERVICES["rayservice-production-70b.yaml"], change)
    args = (doc,) if check is rules.node_problems else (doc, _cfg(doc))
    problems = check(*args)
    assert any(words in p for p in problems), problems


# -- the objects around the RayServices ------------------------------------------------------------------------
def test_podmonitor_selects_every_ray_pod_and_port():
    pm = next(d for _, d in DOCS if d["kind"] == "PodMonitor")
    want = pm["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in pm["spec"]["podMetricsEndpoints"]}
    assert "metrics" in ports
    for name, doc in RAYSERVICES.items():
        for group, template in ray_pod_templates(doc):
            labels = {**template.get("metadata", {}).get("labels", {}), "ray.io/is-ray-node": "yes"}  # KubeRay's
            assert all(labels.get(k) == v for k, v in want.items()), (name, group)
            assert "app.kubernetes.io/name" not in labels      # KubeRay sets it to kuberay on Ray pods
