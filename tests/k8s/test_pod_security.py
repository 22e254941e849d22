"""Issue 23, point 2: every pod of the RayServices passes Pod Security *restricted* (tests/k8s/pss.py), and the
NetworkPolicy admits exactly what Ray and serving need (tests/k8s/netpol.py)."""
from __future__ import annotations

import copy

import pytest

from tests.k8s import rules
from tests.k8s.netpol import Pod, admitted
from tests.k8s.pss import ray_pod_specs, violations
from tests.k8s.validators import ROOT, load_docs, ray_pod_templates

RAYSERVICES = {p.name: d for p in sorted((ROOT / "k8s").glob("rayservice-*.yaml")) for d in load_docs(p)}
POLICIES = [d for d in load_docs(ROOT / "k8s" / "networkpolicy.yaml") if d["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("name", sorted(RAYSERVICES))
def test_every_pod_passes_pod_security_restricted(name):
    specs = ray_pod_specs(RAYSERVICES[name])
    assert specs and all(violations(spec) == [] for _, spec in specs), \
        {group: violations(spec) for group, spec in specs}
    for _, spec in specs:               # set where KubeRay lets us: on the pod and on each container we write
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["containers"][0]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_the_production_cluster_uses_kuberays_token_auth():
    """authOptions (KubeRay >= 1.5.1) needs Ray >= 2.52; the probes only use paths Ray's token check leaves
    public (its dashboard agent's PUBLIC_EXACT_PATHS) or Serve's application port."""
    from ray.dashboard.http_server_agent import PUBLIC_EXACT_PATHS
    assert "/api/healthz" in PUBLIC_EXACT_PATHS
    rc = RAYSERVICES["rayservice-production-70b.yaml"]["spec"]["rayClusterConfig"]
    assert rc["authOptions"] == {"mode": "token"}
    assert tuple(map(int, rc["rayVersion"].split(".")[:2])) >= (2, 52)
    for _, template in ray_pod_templates(RAYSERVICES["rayservice-production-70b.yaml"]):
        c = template["spec"]["containers"][0]
        for probe in (c["readinessProbe"], c["livenessProbe"]):
            get = probe["httpGet"]         # Ray's agent: /api/healthz is public; port 8000 is Serve's app
            assert (get["path"], get["port"]) in {("/api/healthz", 52365), ("/health", 8000)}, get


def _ray_container(doc):
    return doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]


BREAKAGES = {
    "no seccomp anywhere": (lambda d: [sc.pop("seccompProfile", None) for _, t in ray_pod_templates(d) for sc in (
        t["spec"]["securityContext"], t["spec"]["containers"][0]["securityContext"])], "seccompProfile None"),
    "container Unconfined": (lambda d: _ray_container(d)["securityContext"].__setitem__(
        "seccompProfile", {"type": "Unconfined"}), "seccompProfile Unconfined"),
    "privilege escalation": (lambda d: _ray_container(d)["securityContext"].pop("allowPrivilegeEscalation"),
                             "allowPrivilegeEscalation is not false"),
    "capabilities kept": (lambda d: _ray_container(d)["securityContext"].pop("capabilities"), "drop ALL"),
    "root allowed": (lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
                     ["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
    "hostPath volume": (lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"].__setitem__(
        "volumes", [{"name": "h", "hostPath": {"path": "/"}}]), "hostPath"),
    "hostNetwork": (lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"].__setitem__(
        "hostNetwork", True), "hostNetwork"),
    "autoscaler sidecar unrestricted": (lambda d: d["spec"]["rayClusterConfig"]["autoscalerOptions"].pop(
        "securityContext"), "autoscaler: allowPrivilegeEscalation"),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_the_checker_catches(breakage):
    change, words = BREAKAGES[breakage]
    doc = copy.deepcopy(RAYSERVICES["rayservice-production-70b.yaml"])
    change(doc)
    found = [v for _, spec in ray_pod_specs(doc) for v in violations(spec)]
    assert any(words in v for v in found), found


# -- NetworkPolicy ---------------------------------------------------------------------------------------------
RAY_POD = Pod({"app.kubernetes.io/part-of": "specserve", "ray.io/is-ray-node": "yes"})
GATEWAY = Pod({"app": "envoy"}, "envoy-gateway-system", {"specserve.io/gateway": "allowed"})
PROMETHEUS = Pod({"app.kubernetes.io/name": "prometheus"}, "monitoring", {"specserve.io/monitoring": "allowed"})
OPERATOR = Pod({"app.kubernetes.io/name": "kuberay-operator"}, "kuberay-system")
SAME_NS = Pod({"app": "some-client"})
STRANGER = Pod({"app": "other"}, "elsewhere")


def test_the_policy_selects_every_ray_pod():
    assert len(POLICIES) == 1
    selector = POLICIES[0]["spec"]["podSelector"]["matchLabels"]
    for name, doc in RAYSERVICES.items():
        for group, template in ray_pod_templates(doc):
            labels = {**template["metadata"]["labels"], "ray.io/is-ray-node": "yes"}     # KubeRay adds the latter
            assert all(labels.get(k) == v for k, v in selector.items()), (name, group)


@pytest.mark.parametrize("name", sorted(RAYSERVICES))
def test_the_policy_admits_what_ray_and_serving_need_and_nothing_else(name):
    cfg = rules.deployed_config(RAYSERVICES[name])
    serve = (cfg.cluster.http_port, cfg.cluster.grpc_port)
    ray_ports = (6379, 52365, 8265, 10001, 12345, 8076) + serve
    for port in ray_ports:
        assert admitted(POLICIES, RAY_POD, RAY_POD, port), port
    for src in (GATEWAY, SAME_NS):
        assert all(admitted(POLICIES, src, RAY_POD, p) for p in serve)
        assert not any(admitted(POLICIES, src, RAY_POD, p) for p in (6379, 8265, 52365, 8080, 10001))
    assert admitted(POLICIES, PROMETHEUS, RAY_POD, 8080) and not admitted(POLICIES, PROMETHEUS, RAY_POD, serve[0])
    assert admitted(POLICIES, OPERATOR, RAY_POD, 8265) and not admitted(POLICIES, OPERATOR, RAY_POD, 6379)
    assert not any(admitted(POLICIES, STRANGER, RAY_POD, p) for p in ray_ports + (8080,))
    assert admitted(POLICIES, STRANGER, Pod({"app": "unrelated"}), 6379)       # other pods: not selected


def test_the_policy_ports_are_the_ports_the_pods_expose():
    named = {}
    for doc in RAYSERVICES.values():
        for _, t in ray_pod_templates(doc):
            named.update({p["name"]: p["containerPort"] for p in t["spec"]["containers"][0].get("ports", [])})
    policy_ports = {p["port"] for r in POLICIES[0]["spec"]["ingress"] for p in r.get("ports", [])}
    assert {named["serve"], named["grpc"], named["metrics"], named["dashboard"]} <= policy_ports
    assert policy_ports <= set(named.values()), policy_ports - set(named.values())


def test_the_evaluator_follows_the_api_rules():
    """Without our policy: nothing is isolated; an empty ingress list isolates the selected pods."""
    assert admitted([], STRANGER, RAY_POD, 6379)
    deny = [{"metadata": {"name": "d"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}]
    assert not admitted(deny, RAY_POD, RAY_POD, 6379)
    same_ns_only = [{"metadata": {"name": "s"}, "spec": {"podSelector": {}, "ingress": [{"from": [
        {"podSelector": {"matchLabels": {"app": "other"}}}]}]}}]
    assert admitted(same_ns_only, Pod({"app": "other"}), RAY_POD, 1)
    assert not admitted(same_ns_only, STRANGER, RAY_POD, 1)            # same labels, other namespace
