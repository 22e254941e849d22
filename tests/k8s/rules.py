"""What a RayService of ours must get right beyond its schema (tests/k8s/test_manifests.py).

Each ``*_problems`` function returns a list of human-readable problems (empty = fine), so the tests can
show both that the manifests pass and that a broken manifest is caught.
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.k8s.validators import ROOT, ray_pod_templates

SERVE_READINESS_PATH = "/health"          # the app's readiness: 200 once warm, 503 before (cluster/serving)
RAY_AGENT_PORT = 52365                    # the dashboard agent: /api/healthz = raylet (+ GCS on the head)
IMAGE_CONFIG_DIR = "/app/configs/"        # where the Dockerfile puts configs/ (WORKDIR /app)
DEPRECATED = ("serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold")


def pyproject_pin(name: str) -> str:
    """The ``==`` version pinned for dependency ``name`` in pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(rf'"{re.escape(name)}(?:\[[^\]]*\])?==([^"]+)"', text)
    assert m, f"{name} is not pinned with == in pyproject.toml"
    return m.group(1)


def project_version() -> str:
    return re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def serve_config(doc: dict) -> dict:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


def repo_config_path(serve_cfg: dict) -> Path:
    """The repo file behind the application's args: ``source`` when the config is inline (what
    ``specserve serve-config --rayservice`` writes), else ``config``, an image path under /app/configs/."""
    args = serve_cfg["applications"][0]["args"]
    if isinstance(args.get("config"), dict):
        assert args.get("source", "").startswith("configs/"), f"args.source {args.get('source')!r}"
        return ROOT / args["source"]
    path = args["config"]
    assert path.startswith(IMAGE_CONFIG_DIR), f"args.config {path!r} is not under {IMAGE_CONFIG_DIR}"
    return ROOT / "configs" / path[len(IMAGE_CONFIG_DIR):]


def deployed_config(doc: dict):
    """The specserve Config a RayService deploys: its inline ``args.config`` (else the file it names)."""
    from cluster.config.schema import config_from_dict, load_config
    args = serve_config(doc)["applications"][0]["args"]
    if isinstance(args.get("config"), dict):
        return config_from_dict(args["config"], source=args.get("source", "inline"))
    return load_config(repo_config_path(serve_config(doc)))


def ray_container(template: dict) -> dict:
    return template["spec"]["containers"][0]          # KubeRay's Ray container is the first one


def head_start_params(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig"]["headGroupSpec"].get("rayStartParams", {})


def coordinator_hosts(doc: dict) -> list[tuple[str, dict]]:
    """Pod templates that may host a Serve replica (the coordinator): every worker group, and the head
    unless it starts with num-cpus 0 (Serve replicas and our actors all ask for CPUs)."""
    templates = ray_pod_templates(doc)
    if str(head_start_params(doc).get("num-cpus", "")) == "0":
        templates = [t for t in templates if t[0] != "head"]
    return templates


def _env(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def _probe_path(probe: dict | None) -> tuple[str | None, object]:
    get = (probe or {}).get("httpGet") or {}
    return get.get("path"), get.get("port")


def _mounted(container: dict, path: str) -> bool:
    return any(path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
               for m in container.get("volumeMounts", []))


def _cpus(container: dict, params: dict) -> float:
    if "num-cpus" in params:
        return float(params["num-cpus"])
    cpu = str(container["resources"]["limits"]["cpu"])
    return float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)


def _gpus(container: dict, params: dict) -> float:
    if "num-gpus" in params:
        return float(params["num-gpus"])
    return float(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def placement_problems(doc: dict, cfg) -> list[str]:
    """The pods that may host the coordinator can run it: they mount every checkpoint / table path the
    config reads, get the API key from a Secret, and serve the app's ports."""
    out = []
    cl = cfg.cluster
    paths = [s.path for s in cfg.models.values() if s.path] + ([cfg.mag.bigram] if cfg.mag and cfg.mag.bigram else [])
    for group, template in coordinator_hosts(doc):
        c = ray_container(template)
        for p in paths:
            if not _mounted(c, p):
                out.append(f"{group}: may host the coordinator but does not mount {p}")
        key = _env(c).get(cl.api_key_env, {}).get("valueFrom", {}).get("secretKeyRef")
        if cl.api_key_file:
            if not _mounted(c, cl.api_key_file):
                out.append(f"{group}: does not mount cluster.api_key_file {cl.api_key_file}")
        elif not key:
            out.append(f"{group}: no {cl.api_key_env} from a Secret (cluster.api_key_env)")
        ports = {p["containerPort"] for p in c.get("ports", [])}
        for port in (cl.http_port, cl.grpc_port):
            if port not in ports:
                out.append(f"{group}: does not expose port {port}")
    return out


def probe_problems(doc: dict, cfg) -> list[str]:
    """Readiness of a pod that may serve = the app's /health through the local Serve proxy; liveness and
    the head's readiness = Ray's node health, never the app's warm-up."""
    out = []
    hosts = {g for g, _ in coordinator_hosts(doc)}
    for group, template in ray_pod_templates(doc):
        c = ray_container(template)
        ready, live = c.get("readinessProbe"), c.get("livenessProbe")
        if group in hosts:
            if _probe_path(ready) != (SERVE_READINESS_PATH, cfg.cluster.http_port):
                out.append(f"{group}: readinessProbe is not GET {SERVE_READINESS_PATH} on port "
                           f"{cfg.cluster.http_port}: {ready}")
        elif _probe_path(ready)[0] == SERVE_READINESS_PATH:
            out.append(f"{group}: readiness of a pod that hosts no replica must not be the app's")
        if _probe_path(live) != ("/api/healthz", RAY_AGENT_PORT):
            out.append(f"{group}: livenessProbe is not GET /api/healthz on the Ray agent ({live})")
        if group == "head" and _probe_path(ready) != ("/api/healthz", RAY_AGENT_PORT):
            out.append(f"head: readinessProbe is not Ray's node health ({ready})")
    if "head" not in hosts and not doc["spec"].get("excludeHeadPodFromServeSvc"):
        out.append("the head hosts no replica but is not excluded from the serve Service "
                   "(excludeHeadPodFromServeSvc)")
    return out


def serve_problems(doc: dict, cfg) -> list[str]:
    """serveConfigV2 agrees with the config it deploys and with what the probes need."""
    from protos.guard import GUARDED_SERVICER_FUNCTIONS
    out = []
    sc = serve_config(doc)
    app = sc["applications"][0]
    if len(sc["applications"]) != 1:
        out.append("one Serve application expected (gRPC without `application` metadata routes to it)")
    if sc.get("proxy_location", "EveryNode") != "EveryNode":
        out.append(f"proxy_location {sc.get('proxy_location')}: workers with replicas need their own proxy "
                   "(their readiness probe goes through it)")
    http, grpc_ = sc.get("http_options", {}), sc.get("grpc_options", {})
    if http.get("host") != "0.0.0.0":
        out.append(f"http_options.host {http.get('host')!r}: probes and the Service reach the pod IP")
    if http.get("port") != cfg.cluster.http_port or grpc_.get("port") != cfg.cluster.grpc_port:
        out.append("http/grpc ports differ from the config's cluster.http_port / grpc_port")
    if grpc_.get("grpc_servicer_functions") != GUARDED_SERVICER_FUNCTIONS:
        out.append(f"grpc_servicer_functions must be {GUARDED_SERVICER_FUNCTIONS}")
    if app.get("import_path") != "cluster.serving.fronts.app:app_builder":
        out.append(f"import_path {app.get('import_path')!r}")
    if app.get("route_prefix") != "/":
        out.append(f"route_prefix {app.get('route_prefix')!r}: the probes GET {SERVE_READINESS_PATH}")
    if app.get("name") != cfg.cluster.app_name:
        out.append(f"application name {app.get('name')!r} != cluster.app_name {cfg.cluster.app_name!r}")
    for key in DEPRECATED:
        if key in doc["spec"]:
            out.append(f"spec.{key}: no longer has any effect in KubeRay")
    return out


def node_problems(doc: dict) -> list[str]:
    """Every Ray container: the pinned Ray version, one image of this project's version, non-root, and
    Serve's gRPC transport limit equal to the guarded deserializers' limit."""
    from protos.guard import MAX_MESSAGE_BYTES
    out = []
    rc = doc["spec"]["rayClusterConfig"]
    if rc.get("rayVersion") != pyproject_pin("ray"):
        out.append(f"rayVersion {rc.get('rayVersion')} != pyproject's ray {pyproject_pin('ray')}")
    images = set()
    for group, template in ray_pod_templates(doc):
        c = ray_container(template)
        images.add(c["image"])
        size = _env(c).get("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", {}).get("value")
        if size != str(MAX_MESSAGE_BYTES):
            out.append(f"{group}: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE {size!r} != {MAX_MESSAGE_BYTES}")
        sec = template["spec"].get("securityContext", {})
        if not (sec.get("runAsNonRoot") and sec.get("runAsUser") == 1000):
            out.append(f"{group}: not runAsNonRoot as the image's user 1000")
        if "metrics" not in {p.get("name") for p in c.get("ports", [])}:
            out.append(f"{group}: no container port named metrics (the PodMonitor scrapes it)")
    if len(images) != 1:
        out.append(f"the Ray containers use different images: {sorted(images)}")
    for image in images:
        if not image.rpartition(":")[2].startswith(project_version() + "-"):
            out.append(f"image {image}: tag does not start with the project version {project_version()}")
    return out


def unit_demand(cfg) -> tuple[dict, list[dict]]:
    """Ray resources of one serving unit: the TP group (one STRICT_PACK bundle set, or None) and the other
    actors, as in cluster/serving/control/unit.py."""
    cl = cfg.cluster
    separated = cl.topology == "separated"
    tp = None
    actors = [{"cpu": cl.coordinator.num_cpus, "gpu": cl.coordinator.num_gpus}]
    if cl.tp_size > 1:
        tp = {"cpu": cl.tp_size * cl.target.num_cpus, "gpu": cl.tp_size * cl.target.num_gpus}
    elif cl.target_placement == "actor":
        actors.append({"cpu": cl.target.num_cpus, "gpu": cl.target.num_gpus})
    if separated and (cfg.drafters or cfg.mag is not None):     # one draft-group actor holds every drafter
        actors.append({"cpu": cl.drafters.num_cpus, "gpu": cl.drafters.num_gpus})
    return tp, actors


def role_gpus(cfg) -> dict[str, float]:
    """GPUs one serving unit asks Ray for, by placement role (cluster/serving/control/unit.py)."""
    cl = cfg.cluster
    on_actors = cl.tp_size > 1 or cl.target_placement == "actor"
    separated = cl.topology == "separated" and bool(cfg.drafters or cfg.mag is not None)
    return {"target": cl.tp_size * cl.target.num_gpus if on_actors else 0.0, "coordinator": cl.coordinator.num_gpus,
            "drafters": cl.drafters.num_gpus if separated else 0.0}


def gpu_problems(doc: dict, cfg) -> list[str]:
    """Each labelled worker group's pod asks Kubernetes for exactly the GPUs of the roles its Ray node labels host
    (a pod per unit and group): fewer and the actors cannot start, more and the extra GPUs idle.  Skipped where a
    role carries no labels (it may then land on any pod)."""
    cl = cfg.cluster
    labels = {role: getattr(cl, role).labels for role in ("target", "coordinator", "drafters")}
    if not all(labels.values()):
        return []
    rc = doc["spec"]["rayClusterConfig"]
    out = []
    for g in rc.get("workerGroupSpecs", []):
        hosted = [r for r, want in labels.items() if want.items() <= g.get("labels", {}).items()]
        want = sum(role_gpus(cfg)[r] for r in hosted)
        have = _gpus(ray_container(g["template"]), g.get("rayStartParams", {}))
        if have != want:
            out.append(f"{g['groupName']}: asks for {have:g} GPUs, its roles {hosted} ask Ray for {want:g}")
    return out


def shm_problems(doc: dict, cfg) -> list[str]:
    """A tensor-parallel target over NCCL: the pods its ranks run on mount a memory-backed /dev/shm (NCCL's
    intra-node transport; a container's default is 64 MiB)."""
    cl = cfg.cluster
    if cl.tp_size < 2 or cl.tp_backend() != "nccl":
        return []
    out = []
    for g in doc["spec"]["rayClusterConfig"].get("workerGroupSpecs", []):
        if not cl.target.labels.items() <= g.get("labels", {}).items():
            continue
        spec = g["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts = [m for m in ray_container(g["template"]).get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        if not any(volumes.get(m["name"], {}).get("emptyDir", {}).get("medium") == "Memory" for m in mounts):
            out.append(f"{g['groupName']}: hosts the NCCL tensor-parallel target without a memory-backed /dev/shm")
    return out


def capacity_problems(doc: dict, cfg) -> list[str]:
    """One serving unit fits one pod of each worker group (first fit, biggest first; the TP group on one
    pod), so the cluster at its minimum size can start it."""
    pods = []
    for group, template in ray_pod_templates(doc):
        params = (doc["spec"]["rayClusterConfig"]["headGroupSpec"] if group == "head" else next(
            g for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == group)
        ).get("rayStartParams", {})
        c = ray_container(template)
        pods.append({"name": group, "cpu": _cpus(c, params), "gpu": _gpus(c, params)})
    tp, actors = unit_demand(cfg)
    need = ([tp] if tp else []) + sorted(actors, key=lambda a: (a["gpu"], a["cpu"]), reverse=True)
    for i, a in enumerate(need):
        pod = next((p for p in pods if p["cpu"] >= a["cpu"] and p["gpu"] >= a["gpu"]), None)
        if pod is None:
            what = "the tensor-parallel group" if tp and i == 0 else "an actor"
            return [f"{what} needing {a['cpu']} CPUs / {a['gpu']} GPUs fits no pod left: {pods}"]
        pod["cpu"] -= a["cpu"]
        pod["gpu"] -= a["gpu"]
    return []
