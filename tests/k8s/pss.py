"""Kubernetes Pod Security Standards, profile *restricted* (https://kubernetes.io/docs/concepts/security/
pod-security-standards/, the controls of policy version "latest" as of Kubernetes 1.34), checked on a pod spec
the way the PodSecurity admission controller checks it: the baseline controls plus the restricted ones, over
every container, init container and ephemeral container.  Windows-only controls (hostProcess) and AppArmor
annotations are out of scope (Linux pods, no annotations of ours); returns human-readable violations.
"""
from __future__ import annotations

ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                   "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
SECCOMP_OK = {"RuntimeDefault", "Localhost"}


def _containers(spec: dict) -> list[tuple[str, dict]]:
    return [(f"{kind} {c.get('name')}", c) for kind in ("containers", "initContainers", "ephemeralContainers")
            for c in spec.get(kind, [])]


def violations(spec: dict) -> list[str]:
    """Every restricted-profile violation of pod spec ``spec``."""
    out = []
    pod = spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(f"{key}: true")
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            out.append(f"volume {v.get('name')}: type {sorted(kinds - ALLOWED_VOLUMES)} not allowed")
    for s in pod.get("sysctls", []):
        if s.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {s.get('name')} is not a safe sysctl")
    out += _selinux(pod, "pod")
    if pod.get("runAsUser") == 0:
        out.append("pod runAsUser: 0")
    pod_seccomp = (pod.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_OK:
        out.append(f"pod seccompProfile {pod_seccomp}")
    for where, c in _containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: adds capabilities {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{where}: procMount {sc['procMount']}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{where}: hostPort")
        out += _selinux(sc, where)
        non_root = sc.get("runAsNonRoot", pod.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{where}: runAsNonRoot is not true (pod or container)")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser: 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in SECCOMP_OK:
            out.append(f"{where}: seccompProfile {seccomp} (RuntimeDefault or Localhost, on the pod or container)")
    return out


def _selinux(sc: dict, where: str) -> list[str]:
    se = sc.get("seLinuxOptions") or {}
    out = []
    if se.get("type") not in SELINUX_TYPES:
        out.append(f"{where}: seLinuxOptions.type {se['type']}")
    if se.get("user") or se.get("role"):
        out.append(f"{where}: seLinuxOptions user/role set")
    return out


def ray_pod_specs(doc: dict) -> list[tuple[str, dict]]:
    """(group, pod spec) of every pod a RayService makes, with the containers KubeRay adds: the autoscaler
    sidecar of the head (its securityContext from ``autoscalerOptions.securityContext``) and the workers'
    ``wait-gcs-ready`` init container (a copy of the Ray container's securityContext, as KubeRay's pod builder
    makes it)."""
    from tests.k8s.validators import ray_pod_templates
    rc = doc["spec"]["rayClusterConfig"]
    out = []
    for group, template in ray_pod_templates(doc):
        spec = dict(template["spec"])
        if group == "head" and rc.get("enableInTreeAutoscaling"):
            auto = rc.get("autoscalerOptions") or {}
            spec["containers"] = [*spec["containers"], {"name": "autoscaler",
                                                        "securityContext": auto.get("securityContext")}]
        if group != "head":
            ray = spec["containers"][0]
            spec["initContainers"] = [*spec.get("initContainers", []), {
                "name": "wait-gcs-ready", "securityContext": ray.get("securityContext")}]
        out.append((group, spec))
    return out
