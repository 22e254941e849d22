"""Issue 23, point 3: the Gateway API front (k8s/gateway.yaml) routes to the serve Services the RayServices
create, on the ports the configs serve, with TLS from the cert-manager Certificate; its objects against the
strict schemas (tests/k8s/schemas.py), and against the upstream CRDs when ``SPECSERVE_CRD_DIR`` provides them."""
from __future__ import annotations

import copy
import os
import re

import pytest

from cluster.serving.grpc_api import SERVICE
from tests.k8s import rules
from tests.k8s.validators import ROOT, custom_errors, load_docs, upstream_crd_validators

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


def test_against_the_upstream_crds():
    """Set SPECSERVE_CRD_DIR to a directory with the Gateway API v1.6.1 standard CRDs (gateways, httproutes,
    grpcroutes), cert-manager v1.21.1's cert-manager.io_certificates.yaml and the Prometheus Operator v0.93.0
    monitoring.coreos.com_podmonitors / _prometheusrules CRDs to check every such manifest against them too."""
    directory = os.environ.get("SPECSERVE_CRD_DIR")
    if not directory:
        pytest.skip("SPECSERVE_CRD_DIR is not set (upstream Gateway API / cert-manager / Prometheus Operator CRDs)")
    validators = upstream_crd_validators(directory)
    docs = [d for p in sorted((ROOT / "k8s").glob("*.yaml")) for d in load_docs(p) if d["kind"] in validators]
    assert {d["kind"] for d in docs} == set(validators), set(validators) - {d["kind"] for d in docs}
    for doc in docs:
        api, validator = validators[doc["kind"]]
        assert doc["apiVersion"] == api
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert errors == [], (doc["kind"], errors)
