"""Validators for the manifests in k8s/ (used by tests/k8s/test_manifests.py).

* KubeRay objects: the ``openAPIV3Schema`` of the served version of the KubeRay CRDs copied to
  tests/k8s/crds/, made strict the way the API server's strict field validation (kubectl's default) is:
  an object schema that lists ``properties`` and has neither ``additionalProperties`` nor
  ``x-kubernetes-preserve-unknown-fields`` rejects other fields. That includes the embedded
  PodTemplateSpec, whose ``metadata`` the CRD limits to labels, annotations, name, namespace and
  finalizers. ``x-kubernetes-list-type: map`` / ``set`` lists are checked for duplicate keys / items.
  CEL rules (``x-kubernetes-validations``) are not evaluated.
* Kubernetes core objects (and the pod templates, Service and metadata inside a RayService): the
  Kubernetes JSON schemas shipped by the ``kubernetes-validate`` package, strict variant.
* Gateway API, cert-manager and Prometheus Operator objects: strict schemas of the fields our manifests may
  use (tests/k8s/schemas.py; their CRDs are not vendored), plus ObjectMeta from the Kubernetes schemas; and
  (``upstream_errors``) the upstream schemas shipped by the npm packages pinned in package.json, which
  ``make setup`` installs into node_modules/ (tests/k8s/upstream_validate.mjs, run by node):
  ``@kubernetes-models/gateway-api`` 2.0.0 (generated from the Go API types of Gateway API v1.5.1, with their
  validation markers), ``@kubernetes-models/cert-manager`` 5.0.1 (from the openAPIV3Schema of cert-manager
  v1.20.2's CRDs) and ``@kubernetes-models/prometheus-operator`` 5.0.1 (from the Prometheus Operator v0.90.1
  CRDs' openAPIV3Schema): their compiled validators for values, their TypeScript declarations for field names.
  ``upstream_crd_validators`` checks against CRD files someone provides (``SPECSERVE_CRD_DIR``).
* ``serveConfigV2``: Ray Serve's own pydantic models (``ServeDeploySchema``), plus a walk over the same
  models that rejects keys they do not declare (Ray's models ignore unknown keys silently).
"""
from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
import typing
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = Path(__file__).resolve().parent / "crds"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
# Kubernetes versions the core objects are checked against: an older one still in wide use, and the newest
# the installed kubernetes-validate ships.
K8S_VERSIONS = ("1.29", "latest")

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_docs(path: Path) -> list[dict]:
    """Every non-empty document of a (multi-document) YAML file."""
    return [d for d in yaml.load_all(Path(path).read_text(), Loader=_Loader) if d is not None]


# -- KubeRay CRDs --------------------------------------------------------------------------------------
def strictify(schema: dict) -> dict:
    """A copy of an openAPIV3Schema in which every object schema with ``properties`` but no
    ``additionalProperties`` / ``x-kubernetes-preserve-unknown-fields`` rejects unknown fields."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(schema)
    return schema


def _list_map_keys(validator, keys, instance, schema):
    """``x-kubernetes-list-type: map``: no two items with the same key tuple (a missing key takes the
    default its schema declares, e.g. ports' protocol TCP)."""
    if schema.get("x-kubernetes-list-type") != "map" or not validator.is_type(instance, "array"):
        return
    props = schema.get("items", {}).get("properties", {})
    seen = {}
    for i, item in enumerate(instance):
        if not isinstance(item, dict):
            continue
        key = tuple(item.get(k, props.get(k, {}).get("default")) for k in keys)
        if key in seen:
            yield jsonschema.ValidationError(
                f"duplicate entries for map key {dict(zip(keys, key))} (items {seen[key]} and {i})")
        seen.setdefault(key, i)


def _list_type(validator, list_type, instance, schema):
    if list_type == "set" and validator.is_type(instance, "array"):
        seen = []
        for item in instance:
            if item in seen:
                yield jsonschema.ValidationError(f"duplicate entry {item!r} in a set")
            seen.append(item)


_KubeValidator = jsonschema.validators.extend(
    jsonschema.Draft7Validator,
    {"x-kubernetes-list-map-keys": _list_map_keys, "x-kubernetes-list-type": _list_type})


@functools.lru_cache(maxsize=None)
def crd_validator(kind: str, version: str):
    """The strict validator of ``kind`` (RayService / RayCluster) at API ``version`` (e.g. v1), from the
    CRD's served version of that name."""
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=_Loader)
    assert crd["spec"]["names"]["kind"] == kind
    served = [v for v in crd["spec"]["versions"] if v["name"] == version and v.get("served")]
    if not served:
        raise ValueError(f"{kind} {version} is not a served version of its CRD")
    schema = strictify(served[0]["schema"]["openAPIV3Schema"])
    _KubeValidator.check_schema(schema)
    return _KubeValidator(schema)


def crd_errors(doc: dict) -> list[str]:
    """Schema errors of a KubeRay object (empty when valid), each with its path."""
    group, _, version = doc.get("apiVersion", "").partition("/")
    if group != "ray.io":
        return [f"apiVersion {doc.get('apiVersion')!r} is not ray.io/..."]
    v = crd_validator(doc["kind"], version)
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(v.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


# -- Kubernetes core objects -----------------------------------------------------------------------------
def k8s_errors(obj: dict, where: str = "") -> list[str]:
    """Errors of a Kubernetes object against kubernetes-validate's strict schemas, for every version in
    K8S_VERSIONS."""
    import pytest
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (a dev extra: pip install -e '.[dev]') is not installed")
    from kubernetes_validate.utils import latest_version
    errors = []
    for version in K8S_VERSIONS:
        version = latest_version() if version == "latest" else version
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(map(str, e.absolute_path)) or "<root>"
            errors.append(f"{where}{path} (Kubernetes {version}): {e.message}")
    return errors


def as_object_meta(metadata: dict) -> dict:
    """Wrap ObjectMeta in a ConfigMap so the Kubernetes schema checks it."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata}


def as_pod_template(template: dict, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def as_service(service: dict, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": service.get("metadata") or {"name": name},
            "spec": service.get("spec", {})}


def ray_pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(group name, pod template) of the head and every worker group of a RayService / RayCluster."""
    rc = doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]
    out = [("head", rc["headGroupSpec"]["template"])]
    out += [(g["groupName"], g["template"]) for g in rc.get("workerGroupSpecs", [])]
    return out


def rayservice_core_errors(doc: dict) -> list[str]:
    """The Kubernetes objects embedded in a RayService, each against the Kubernetes schemas."""
    errors = k8s_errors(as_object_meta(doc["metadata"]), "metadata: ")
    for group, template in ray_pod_templates(doc):
        errors += k8s_errors(as_pod_template(template, f"{doc['metadata']['name']}-{group}"),
                             f"{group} pod template: ")
    if "serveService" in doc["spec"]:
        errors += k8s_errors(as_service(doc["spec"]["serveService"], doc["metadata"]["name"] + "-serve"),
                             "serveService: ")
    return errors


# -- the other custom resources (tests/k8s/schemas.py) -----------------------------------------------------
def custom_errors(doc: dict) -> list[str]:
    """A Gateway API, cert-manager or Prometheus Operator object against its strict schema (schemas.SCHEMAS),
    its metadata against ObjectMeta."""
    from tests.k8s.schemas import SCHEMAS
    v = jsonschema.Draft7Validator(SCHEMAS[doc.get("kind")])
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(doc)]
    return errors + k8s_errors(as_object_meta(doc.get("metadata", {})), "metadata: ")


podmonitor_errors = custom_errors


def upstream_crd_validators(directory: Path) -> dict:
    """{kind: strict validator of its served storage version} for every CRD file in ``directory`` (the upstream
    Gateway API, cert-manager and Prometheus Operator CRDs, when someone provides them)."""
    out = {}
    for path in sorted(Path(directory).glob("*.yaml")):
        for crd in load_docs(path):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            for version in crd["spec"]["versions"]:
                if version.get("served") and version.get("storage"):
                    schema = strictify(version["schema"]["openAPIV3Schema"])
                    out[crd["spec"]["names"]["kind"]] = (f"{crd['spec']['group']}/{version['name']}",
                                                         _KubeValidator(schema))
    return out


UPSTREAM_SCRIPT = Path(__file__).resolve().parent / "upstream_validate.mjs"


class UpstreamUnavailable(Exception):
    """node or the npm packages of package.json are not installed (``make setup`` installs them)."""


def upstream_pins() -> dict:
    """{npm package: exact version} as package.json pins them."""
    return json.loads((ROOT / "package.json").read_text())["devDependencies"]


def upstream_errors(docs: list[dict]) -> tuple[dict, list[list[str]]]:
    """({npm package: installed version}, errors of each doc) against the upstream schemas of the pinned npm
    packages, every doc in one node process (tests/k8s/upstream_validate.mjs). Each error names its path and
    ends with the check that found it: ``[schema]`` (the compiled validator: types, enums, patterns, bounds,
    required fields) or ``[declarations]`` (the TypeScript declarations: a field the schema does not have)."""
    node = shutil.which("node")
    if node is None:
        raise UpstreamUnavailable("node is not installed (Debian: apt-get install nodejs npm; then make setup)")
    missing = [name for name in upstream_pins() if not (ROOT / "node_modules" / name / "package.json").is_file()]
    if missing:
        raise UpstreamUnavailable(f"{', '.join(missing)} not in node_modules/ (make setup, or: npm ci)")
    done = subprocess.run([node, str(UPSTREAM_SCRIPT)], input=json.dumps(docs), capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{UPSTREAM_SCRIPT.name} failed ({done.returncode}): {done.stderr[-4000:]}")
    out = json.loads(done.stdout)
    return out["packages"], out["errors"]


# -- dispatch -----------------------------------------------------------------------------------------------
def manifest_errors(doc: dict) -> list[str]:
    """All schema errors of one manifest document, whatever its kind."""
    kind = doc.get("kind")
    if kind in CRD_FILES:
        errors = crd_errors(doc)
        if not errors and kind == "RayService":
            errors = rayservice_core_errors(doc)
        return errors
    from tests.k8s.schemas import SCHEMAS
    if kind in SCHEMAS:
        return custom_errors(doc)
    return k8s_errors(doc, f"{kind}/{doc.get('metadata', {}).get('name')}: ")


# -- Ray Serve's config schema --------------------------------------------------------------------------------
def _model_types(annotation) -> list:
    """The pydantic model classes an annotation admits (through Optional / Union / List / Annotated)."""
    from pydantic import BaseModel
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _model_types(arg)]


def unknown_serve_keys(model, data, path: str = "") -> list[str]:
    """Keys of ``data`` that the pydantic ``model`` (and the models of its fields, recursively) does not
    declare: Ray's Serve schema models accept and drop them, so a typo would pass unnoticed."""
    if not isinstance(data, dict):
        return []
    fields = model.model_fields
    names = {n: n for n in fields} | {f.alias: n for n, f in fields.items() if f.alias}
    out = []
    for key, value in data.items():
        if key not in names:
            out.append(f"{path}{key}: not a field of {model.__name__}")
            continue
        for sub in _model_types(fields[names[key]].annotation)[:1]:
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                where = f"{path}{key}[{i}]." if isinstance(value, list) else f"{path}{key}."
                out += unknown_serve_keys(sub, item, where)
    return out


def serve_config_errors(text: str) -> list[str]:
    """Errors of a ``serveConfigV2`` string against Ray Serve's ``ServeDeploySchema`` (strict keys)."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return [f"serveConfigV2 is not YAML: {e}"]
    errors = unknown_serve_keys(ServeDeploySchema, data)
    try:
        ServeDeploySchema.model_validate(data)
    except ValidationError as e:
        errors += [f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    return errors
