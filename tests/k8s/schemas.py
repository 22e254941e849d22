"""Strict schemas of the custom resources around the RayServices whose CRDs are not vendored in the repository:
Gateway API (gateway.networking.k8s.io/v1 Gateway, HTTPRoute, GRPCRoute; written from the standard channel of
v1.6.1), cert-manager's Certificate (cert-manager.io/v1, from v1.21.1) and the Prometheus Operator's PodMonitor
and PrometheusRule (monitoring.coreos.com/v1, from v0.93.0).  Each lists the fields of those CRDs that our
manifests may use, with their types, enums and patterns, and rejects any other field (what strict field
validation does); metadata is checked as ObjectMeta by the Kubernetes schemas.

The manifests of these kinds are also checked, by default, against upstream schemas (tests/k8s/test_gateway.py):
those of the npm packages pinned in package.json, which ``make setup`` installs: ``@kubernetes-models/gateway-api``
2.0.0 (generated from the Go API types of Gateway API v1.5.1 with their validation markers),
``@kubernetes-models/cert-manager`` 5.0.1 (from the openAPIV3Schema of cert-manager v1.20.2's CRDs) and
``@kubernetes-models/prometheus-operator`` 5.0.1 (from the openAPIV3Schema of the Prometheus Operator v0.90.1
CRDs); values by their compiled validators, field names by their TypeScript declarations. With
``SPECSERVE_CRD_DIR`` pointing at a directory holding upstream CRD files (any ``*.yaml`` whose
``spec.names.kind`` is one of these kinds), tests/k8s/test_gateway.py also validates against those.
"""
from __future__ import annotations


def _obj(props: dict, required=()) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False, "required": list(required)}


def _arr(items: dict, **kw) -> dict:
    return {"type": "array", "items": items, **kw}


def _top(api: str, kind: str, spec: dict) -> dict:
    return _obj({"apiVersion": {"const": api}, "kind": {"const": kind}, "metadata": {"type": "object"},
                 "spec": spec}, ["apiVersion", "kind", "metadata", "spec"])


_STR, _STRS, _INT = {"type": "string"}, _arr({"type": "string"}), {"type": "integer"}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_HOST = {"type": "string", "pattern": r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
_GW_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
PROM_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                              r"(([0-9]+)s)?(([0-9]+)ms)?)$"}
_LABELS = {"type": "object", "additionalProperties": _STR}
_SELECTOR = _obj({"matchLabels": _LABELS, "matchExpressions": _arr(_obj(
    {"key": _STR, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]}, "values": _STRS},
    ["key", "operator"]))})

# -- Gateway API ---------------------------------------------------------------------------------------------
_PARENT_REF = _obj({"group": _STR, "kind": _STR, "namespace": _STR, "name": _NAME, "sectionName": _STR,
                    "port": _PORT}, ["name"])
_BACKEND_REF = _obj({"group": _STR, "kind": _STR, "name": _NAME, "namespace": _STR, "port": _PORT,
                     "weight": {"type": "integer", "minimum": 0, "maximum": 1000000}}, ["name"])
_HEADER_MATCH = _obj({"type": {"enum": ["Exact", "RegularExpression"]}, "name": _STR, "value": _STR},
                     ["name", "value"])
_ROUTE_COMMON = {"parentRefs": _arr(_PARENT_REF, maxItems=32), "hostnames": _arr(_HOST, maxItems=16)}
_GATEWAY = _obj({
    "gatewayClassName": _NAME,
    "listeners": _arr(_obj({
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}, "hostname": _HOST,
        "port": _PORT, "protocol": {"type": "string", "pattern": r"^[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?$|"
                                                                 r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]"
                                                                 r"([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]+$"},
        "tls": _obj({"mode": {"enum": ["Terminate", "Passthrough"]},
                     "certificateRefs": _arr(_obj({"group": _STR, "kind": _STR, "name": _NAME, "namespace": _STR},
                                                  ["name"]), maxItems=64),
                     "options": {"type": "object", "additionalProperties": _STR}}),
        "allowedRoutes": _obj({"namespaces": _obj({"from": {"enum": ["All", "Selector", "Same", "None"]},
                                                   "selector": _SELECTOR}),
                               "kinds": _arr(_obj({"group": _STR, "kind": _STR}, ["kind"]), maxItems=8)}),
    }, ["name", "port", "protocol"]), minItems=1, maxItems=64),
    "addresses": _arr(_obj({"type": _STR, "value": _STR})),
    "infrastructure": _obj({"labels": _LABELS, "annotations": _LABELS}),
}, ["gatewayClassName", "listeners"])
_HTTPROUTE = _obj({**_ROUTE_COMMON, "rules": _arr(_obj({
    "name": _STR,
    "matches": _arr(_obj({
        "path": _obj({"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                      "value": {"type": "string", "maxLength": 1024}}),
        "headers": _arr(_HEADER_MATCH), "queryParams": _arr(_HEADER_MATCH),
        "method": {"enum": ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"]}}),
        maxItems=64),
    "filters": _arr({"type": "object"}), "backendRefs": _arr(_BACKEND_REF),
    "timeouts": _obj({"request": _GW_DURATION, "backendRequest": _GW_DURATION})}), maxItems=16)})
_GRPCROUTE = _obj({**_ROUTE_COMMON, "rules": _arr(_obj({
    "name": _STR,
    "matches": _arr(_obj({"method": _obj({"type": {"enum": ["Exact", "RegularExpression"]},
                                          "service": {"type": "string", "maxLength": 1024},
                                          "method": {"type": "string", "maxLength": 1024}}),
                          "headers": _arr(_HEADER_MATCH)}), maxItems=64),
    "filters": _arr({"type": "object"}), "backendRefs": _arr(_BACKEND_REF)}), maxItems=16)})

# -- cert-manager ----------------------------------------------------------------------------------------------
_CERTIFICATE = _obj({
    "secretName": _NAME, "dnsNames": _arr(_STR), "commonName": _STR, "duration": _STR, "renewBefore": _STR,
    "usages": _STRS, "isCA": {"type": "boolean"},
    "issuerRef": _obj({"name": _NAME, "kind": _STR, "group": _STR}, ["name"]),
    "privateKey": _obj({"algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]}, "size": _INT,
                        "rotationPolicy": {"enum": ["Never", "Always"]}, "encoding": {"enum": ["PKCS1", "PKCS8"]}}),
}, ["secretName", "issuerRef"])

# -- Prometheus Operator ---------------------------------------------------------------------------------------
_RELABEL = _obj({"sourceLabels": _STRS, "separator": _STR, "targetLabel": _STR, "regex": _STR,
                 "modulus": _INT, "replacement": _STR,
                 "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
                                     "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep",
                                     "lowercase", "Lowercase", "uppercase", "Uppercase", "keepequal",
                                     "KeepEqual", "dropequal", "DropEqual"]}})
_PODMONITOR = _obj({
    "jobLabel": _STR, "podTargetLabels": _STRS,
    "namespaceSelector": _obj({"any": {"type": "boolean"}, "matchNames": _STRS}),
    "selector": _SELECTOR,
    "podMetricsEndpoints": _arr(_obj({
        "port": _STR, "portNumber": _PORT, "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]}, "interval": PROM_DURATION,
        "scrapeTimeout": PROM_DURATION, "honorLabels": {"type": "boolean"},
        "relabelings": _arr(_RELABEL), "metricRelabelings": _arr(_RELABEL)}), minItems=1),
}, ["selector", "podMetricsEndpoints"])
_RULE = {"type": "object", "additionalProperties": False, "required": ["expr"],
         "properties": {"alert": _STR, "record": _STR, "expr": {"type": ["string", "integer"]},
                        "for": PROM_DURATION, "keep_firing_for": PROM_DURATION, "labels": _LABELS,
                        "annotations": _LABELS},
         "oneOf": [{"required": ["alert"], "not": {"required": ["record"]}},
                   {"required": ["record"], "not": {"required": ["alert"]}}]}
_PROMETHEUSRULE = _obj({"groups": _arr(_obj({
    "name": {"type": "string", "minLength": 1}, "interval": PROM_DURATION, "query_offset": PROM_DURATION,
    "limit": _INT, "labels": _LABELS, "rules": _arr(_RULE)}, ["name"]))})

SCHEMAS = {
    "Gateway": _top("gateway.networking.k8s.io/v1", "Gateway", _GATEWAY),
    "HTTPRoute": _top("gateway.networking.k8s.io/v1", "HTTPRoute", _HTTPROUTE),
    "GRPCRoute": _top("gateway.networking.k8s.io/v1", "GRPCRoute", _GRPCROUTE),
    "Certificate": _top("cert-manager.io/v1", "Certificate", _CERTIFICATE),
    "PodMonitor": _top("monitoring.coreos.com/v1", "PodMonitor", _PODMONITOR),
    "PrometheusRule": _top("monitoring.coreos.com/v1", "PrometheusRule", _PROMETHEUSRULE),
}
