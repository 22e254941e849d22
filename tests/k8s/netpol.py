"""Which connections a set of NetworkPolicies admits, by the rules of the Kubernetes API (networking.k8s.io/v1,
https://kubernetes.io/docs/concepts/services-networking/network-policies/): a pod selected by no policy of type
Ingress accepts everything; a selected pod accepts what at least one ingress rule of a selecting policy admits
(a rule: any of its ``from`` peers, on any of its ``ports``; an empty or absent list means all).  A peer with
only ``podSelector`` means pods of the policy's own namespace, with only ``namespaceSelector`` every pod of the
matching namespaces, with both the matching pods of the matching namespaces.  Named ports and ipBlocks (not
used by our policy) never match here.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pod:
    labels: dict = field(default_factory=dict)
    namespace: str = "specserve"
    namespace_labels: dict = field(default_factory=dict)


def matches(selector: dict | None, labels: dict) -> bool:
    """LabelSelector semantics (an empty selector matches everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _peer(peer: dict, src: Pod, policy_ns: str) -> bool:
    pods, namespaces = peer.get("podSelector"), peer.get("namespaceSelector")
    if pods is None and namespaces is None:
        return False                                   # ipBlock only
    if namespaces is None and src.namespace != policy_ns:
        return False
    if namespaces is not None and not matches(namespaces, {"kubernetes.io/metadata.name": src.namespace,
                                                          **src.namespace_labels}):
        return False
    return pods is None or matches(pods, src.labels)


def _port(ports: list | None, port: int) -> bool:
    return not ports or any(p.get("port") == port or (isinstance(p.get("port"), int) and p.get("endPort")
                                                     and p["port"] <= port <= p["endPort"]) for p in ports)


def admitted(policies: list[dict], src: Pod, dst: Pod, port: int) -> bool:
    """Whether a TCP connection from ``src`` to ``dst``:``port`` is admitted by ``policies``."""
    selecting = [p for p in policies if p.get("metadata", {}).get("namespace", dst.namespace) == dst.namespace
                 and matches(p["spec"].get("podSelector"), dst.labels)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for p in selecting:
        ns = p.get("metadata", {}).get("namespace", dst.namespace)
        for rule in p["spec"].get("ingress") or []:
            peers = rule.get("from")
            if _port(rule.get("ports"), port) and (not peers or any(_peer(x, src, ns) for x in peers)):
                return True
    return False
