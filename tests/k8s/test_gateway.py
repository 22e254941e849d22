"""Issue 23, point 3: the Gateway API front (k8s/gateway.yaml) routes to the serve Services the RayServices
create, on the ports the configs serve, with TLS from the cert-manager Certificate; its objects against the
strict schemas (tests/k8s/schemas.py).

Every Gateway API, cert-manager and Prometheus Operator manifest in k8s/ (gateway.yaml, monitoring.yaml,
prometheusrule.yaml) is also checked, by default, against the upstream schemas of the npm packages pinned in
package.json (``make setup`` runs ``npm ci``; tests/k8s/upstream_validate.mjs, one node process):

* Gateway, HTTPRoute, GRPCRoute (gateway.networking.k8s.io/v1): ``@kubernetes-models/gateway-api`` 2.0.0,
  generated from the Go API types of Gateway API v1.5.1 (sigs.k8s.io/gateway-api/apis/v1) with their
  kubebuilder validation markers (enums, patterns, bounds, required), what its CRDs are generated from (these
  types also carry the experimental channel's fields, which the standard-channel CRDs leave out);
* Certificate (cert-manager.io/v1): ``@kubernetes-models/cert-manager`` 5.0.1, generated from the
  openAPIV3Schema of cert-manager v1.20.2's CRDs (cert-manager.crds.yaml);
* PodMonitor, PrometheusRule (monitoring.coreos.com/v1): ``@kubernetes-models/prometheus-operator`` 5.0.1,
  generated from the openAPIV3Schema of the Prometheus Operator v0.90.1 CRDs (stripped-down-crds.yaml).

Values go through each package's compiled validator; field names through its TypeScript declarations
(TypeScript's excess-property check), as strict field validation would. Without node or node_modules/ the check
skips, except where ``SPECSERVE_REQUIRE_NODE`` is set (by .ci/run) or ``CI`` is, where it fails.
``SPECSERVE_CRD_DIR`` pointing at upstream CRD files (of any version; the manifests were written against
Gateway API v1.6.1, cert-manager v1.21.1 and Prometheus Operator v0.93.0, and checked against those CRDs this
way when written) adds a check against their openAPIV3Schema, made strict."""
from __future__ import annotations

import copy
import os
import re

import pytest

from cluster.serving.fronts.grpc_api import SERVICE
from tests.k8s import rules
from tests.k8s.schemas import SCHEMAS
from tests.k8s.validators import (ROOT, UpstreamUnavailable, custom_errors, load_docs, upstream_crd_validators,
                                  upstream_errors, upstream_pins)

DOCS = {d["kind"]: d for d in load_docs(ROOT / "k8s" / "gateway.yaml")}
RAYSERVICES = {d["spec"]["serveService"]["metadata"]["name"]: d for p in sorted((ROOT / "k8s").glob("rayservice-*"))
               for d in load_docs(p)}
HEALTH = "grpc.health.v1.Health"


def _seconds(duration: str) -> float:
    unit = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * unit[u] for n, u in re.findall(r"(\d+)(ms|h|m|s)", duration))


def _listener(route):
    gw = DOCS["Gateway"]
    (ref,) = route["spec"]["parentRefs"]
    assert ref["name"] == gw["metadata"]["name"]
    return next(x for x in gw["spec"]["listeners"] if x["name"] == ref["sectionName"])


@pytest.mark.parametrize("kind,port_name", [("HTTPRoute", "http"), ("GRPCRoute", "grpc")])
def test_routes_reach_the_serve_service_port_the_config_serves(kind, port_name):
    route = DOCS[kind]
    listener = _listener(route)
    assert listener["protocol"] == "HTTPS" and listener["tls"]["mode"] == "Terminate"
    assert {"kind": kind} in listener["allowedRoutes"]["kinds"]
    assert route["spec"]["hostnames"] == [listener["hostname"]]
    for rule in route["spec"]["rules"]:
        for ref in rule["backendRefs"]:
            doc = RAYSERVICES[ref["name"]]
            ports = {p["name"]: p for p in doc["spec"]["serveService"]["spec"]["ports"]}
            cfg = rules.deployed_config(doc)
            assert ref["port"] == ports[port_name]["port"] == {"http": cfg.cluster.http_port,
                                                               "grpc": cfg.cluster.grpc_port}[port_name]
            if kind == "GRPCRoute":         # the Gateway must speak HTTP/2 cleartext to Serve's gRPC proxy
                assert ports[port_name]["appProtocol"] == "kubernetes.io/h2c"


def test_the_http_route_serves_the_openai_paths_and_outlasts_the_server_deadline():
    (rule,) = DOCS["HTTPRoute"]["spec"]["rules"]
    paths = {(m["path"]["type"], m["path"]["value"]) for m in rule["matches"]}
    assert ("PathPrefix", "/v1") in paths and ("Exact", "/health") in paths
    doc = RAYSERVICES[rule["backendRefs"][0]["name"]]
    timeout = rules.deployed_config(doc).engine.request_timeout_s
    assert _seconds(rule["timeouts"]["request"]) >= timeout      # else the Gateway cuts a stream the server runs


def test_the_grpc_route_serves_the_api_and_health_only():
    (rule,) = DOCS["GRPCRoute"]["spec"]["rules"]
    assert sorted(m["method"]["service"] for m in rule["matches"]) == sorted([SERVICE, HEALTH])
    assert all(m["method"]["type"] == "Exact" and "method" not in m["method"] for m in rule["matches"])


def test_tls_comes_from_the_certificate_for_every_host():
    cert = DOCS["Certificate"]["spec"]
    for listener in DOCS["Gateway"]["spec"]["listeners"]:
        assert listener["tls"]["certificateRefs"] == [{"kind": "Secret", "name": cert["secretName"]}]
        assert listener["hostname"] in cert["dnsNames"]


@pytest.mark.parametrize("kind,change,words", [
    ("HTTPRoute", lambda d: d["spec"]["rules"][0].__setitem__("timeout", {"request": "600s"}), "timeout"),
    ("HTTPRoute", lambda d: d["spec"]["rules"][0]["timeouts"].__setitem__("request", "10 minutes"), "10 minutes"),
    ("HTTPRoute", lambda d: d["spec"]["rules"][0]["matches"][0]["path"].__setitem__("type", "Prefix"), "Prefix"),
    ("GRPCRoute", lambda d: d["spec"]["rules"][0]["backendRefs"][0].__setitem__("port", 0), "0"),
    ("Gateway", lambda d: d["spec"]["listeners"][0]["tls"].__setitem__("mode", "Terminated"), "Terminated"),
    ("Gateway", lambda d: d["spec"].pop("gatewayClassName"), "gatewayClassName"),
    ("Certificate", lambda d: d["spec"].pop("issuerRef"), "issuerRef"),
    ("Certificate", lambda d: d["spec"]["privateKey"].__setitem__("algorithm", "DSA"), "DSA"),
])
def test_the_schemas_reject(kind, change, words):
    doc = copy.deepcopy(DOCS[kind])
    change(doc)
    errors = custom_errors(doc)
    assert any(words in e for e in errors), errors


# every manifest of the kinds tests/k8s/schemas.py covers, wherever in k8s/ it is
MANIFESTS = [d for p in sorted((ROOT / "k8s").glob("*.yaml")) for d in load_docs(p) if d["kind"] in SCHEMAS]


def _first(kind):
    return copy.deepcopy(next(d for d in MANIFESTS if d["kind"] == kind))


def _at(path, act):
    """A change that applies ``act(container, key)`` at a dotted path (numbers index lists)."""
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]

    def change(doc):
        for key in parents:
            doc = doc[key]
        act(doc, last)
    return change


def _set(path, value):
    return _at(path, lambda d, k: d.__setitem__(k, value))


def _pop(path):
    return _at(path, lambda d, k: d.pop(k))


# (kind, change to the shipped manifest, words one error must contain, the check that must find it)
UPSTREAM_REJECTS = [
    ("HTTPRoute", _set("spec.rules.0.timeout", {"request": "600s"}), "spec.rules.0.timeout:", "declarations"),
    ("HTTPRoute", _set("spec.rules.0.matches.0.path.type", "Prefix"), "spec.rules.0.matches.0.path.type:", "schema"),
    ("HTTPRoute", _set("spec.rules.0.timeouts.request", "10 minutes"), "spec.rules.0.timeouts.request:", "schema"),
    ("HTTPRoute", _set("apiVersion", "gateway.networking.k8s.io/v1beta2"), "no upstream schema", None),
    ("GRPCRoute", _set("spec.rules.0.backendRefs.0.port", 0), "spec.rules.0.backendRefs.0.port:", "schema"),
    ("GRPCRoute", _set("spec.rules.0.matches.0.method.type", "Prefix"), "spec.rules.0.matches.0.method.type:",
     "schema"),
    ("GRPCRoute", _set("spec.rules.0.backendRef", [{"name": "x", "port": 9000}]), "spec.rules.0.backendRef:",
     "declarations"),
    ("Gateway", _set("spec.listeners.0.tls.mode", "Terminated"), "spec.listeners.0.tls.mode:", "schema"),
    ("Gateway", _pop("spec.gatewayClassName"), "gatewayClassName", "schema"),
    ("Gateway", _set("spec.listeners.0.hostName", "x.example.com"), "spec.listeners.0.hostName:", "declarations"),
    ("Certificate", _pop("spec.issuerRef"), "issuerRef", "schema"),
    ("Certificate", _set("spec.privateKey.algorithm", "DSA"), "spec.privateKey.algorithm:", "schema"),
    ("Certificate", _set("spec.dnsName", ["x.example.com"]), "spec.dnsName:", "declarations"),
    ("PodMonitor", _set("spec.podMetricsEndpoints.0.intervall", "15s"), "spec.podMetricsEndpoints.0.intervall:",
     "declarations"),
    ("PodMonitor", _set("spec.podMetricsEndpoints.0.interval", "15 seconds"), "spec.podMetricsEndpoints.0.interval:",
     "schema"),
    ("PodMonitor", _set("spec.podMetricsEndpoints.0.relabelings.0.action", "rename"),
     "spec.podMetricsEndpoints.0.relabelings.0.action:", "schema"),
    ("PrometheusRule", _set("spec.groups.0.rules.0.for", "5 minutes"), "spec.groups.0.rules.0.for:", "schema"),
    ("PrometheusRule", _set("spec.groups.0.rule", []), "spec.groups.0.rule:", "declarations"),
]


@pytest.fixture(scope="module")
def upstream():
    """(installed package versions, errors of each manifest, errors of each UPSTREAM_REJECTS case): one node run."""
    cases = []
    for kind, change, _, _ in UPSTREAM_REJECTS:
        doc = _first(kind)
        change(doc)
        cases.append(doc)
    try:
        packages, errors = upstream_errors(MANIFESTS + cases)
    except UpstreamUnavailable as e:
        if os.environ.get("SPECSERVE_REQUIRE_NODE") or os.environ.get("CI"):
            pytest.fail(f"the upstream schema check must run here (SPECSERVE_REQUIRE_NODE / CI): {e}; "
                        "apt-get install nodejs npm, then make setup")
        pytest.skip(f"upstream schemas not installed: {e}")
    return packages, errors[:len(MANIFESTS)], errors[len(MANIFESTS):]


def test_every_manifest_passes_the_upstream_schemas(upstream):
    packages, errors, _ = upstream
    assert packages == upstream_pins(), "node_modules/ is not what package.json pins: make setup (npm ci)"
    assert {d["kind"] for d in MANIFESTS} == set(SCHEMAS), set(SCHEMAS) - {d["kind"] for d in MANIFESTS}
    bad = {f"{d['kind']}/{d['metadata']['name']}": e for d, e in zip(MANIFESTS, errors) if e}
    assert bad == {}


@pytest.mark.parametrize("case", range(len(UPSTREAM_REJECTS)),
                         ids=[f"{k}-{w.rstrip(':')}" for k, _, w, _ in UPSTREAM_REJECTS])
def test_the_upstream_schemas_reject(upstream, case):
    _, _, errors = upstream
    _, _, words, check = UPSTREAM_REJECTS[case]
    found = [e for e in errors[case] if words in e and (check is None or e.endswith(f"[{check}]"))]
    assert found, errors[case]


def test_against_crd_files_in_specserve_crd_dir():
    """Set SPECSERVE_CRD_DIR to a directory with upstream CRD files, e.g. the Gateway API v1.6.1 standard CRDs
    (gateways, httproutes, grpcroutes), cert-manager v1.21.1's cert-manager.io_certificates.yaml and the
    Prometheus Operator v0.93.0 monitoring.coreos.com_podmonitors / _prometheusrules CRDs (the versions the
    manifests were written against), to check every such manifest against their openAPIV3Schema (strict) too."""
    directory = os.environ.get("SPECSERVE_CRD_DIR")
    if not directory:
        pytest.skip("SPECSERVE_CRD_DIR is not set (upstream Gateway API / cert-manager / Prometheus Operator CRDs)")
    validators = upstream_crd_validators(directory)
    docs = [d for d in MANIFESTS if d["kind"] in validators]
    assert {d["kind"] for d in docs} == set(validators), set(validators) - {d["kind"] for d in docs}
    for doc in docs:
        api, validator = validators[doc["kind"]]
        assert doc["apiVersion"] == api
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert errors == [], (doc["kind"], errors)
