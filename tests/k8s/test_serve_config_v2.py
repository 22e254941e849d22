"""serveConfigV2 of every RayService in k8s/ against Ray Serve's own schema and code, and against the config it
carries inline: what `specserve serve-config --rayservice` writes (no cluster needed)."""
from __future__ import annotations

import copy

import pytest
import yaml

from cluster.config.schema import load_config
from cluster.serving.ops.deploy import serve_config
from tests.k8s import rules
from tests.k8s.validators import ROOT, load_docs, serve_config_errors

# Ray's own Serve config models use pydantic-1-style Field(...) arguments: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

RAYSERVICES = {p.name: d for p in sorted((ROOT / "k8s").glob("*.yaml")) for d in load_docs(p)
               if d["kind"] == "RayService"}
EXPECT = sorted(RAYSERVICES)


def _cfg(doc):
    return rules.deployed_config(doc)


# -- serveConfigV2 against Ray Serve's own schema and code ---------------------------------------------------
@pytest.mark.parametrize("name", EXPECT)
def test_serve_config_validates(name):
    assert serve_config_errors(RAYSERVICES[name]["spec"]["serveConfigV2"]) == []


def _with_serve(doc, change):
    sc = rules.serve_config(doc)
    change(sc)
    return yaml.safe_dump(sc)


@pytest.mark.parametrize("change,words", [
    (lambda s: s.__setitem__("proxy_locaton", "EveryNode"), "proxy_locaton"),
    (lambda s: s["applications"][0].__setitem__("import_paht", "x:y"), "import_paht"),
    (lambda s: s["applications"][0].__setitem__("deployments", [{"name": "SpecServe", "num_replica": 2}]),
     "num_replica"),
    (lambda s: s["applications"][0].__setitem__("deployments", [
        {"name": "SpecServe", "autoscaling_config": {"max_replica": 8}}]), "max_replica"),
    (lambda s: s["grpc_options"].__setitem__("port", "nine thousand"), "grpc_options.port"),
    (lambda s: s.__setitem__("proxy_location", "Everywhere"), "proxy_location"),
])
def test_serve_schema_rejects(change, words):
    errors = serve_config_errors(_with_serve(RAYSERVICES["rayservice-production-70b.yaml"], change))
    assert any(words in e for e in errors), errors


@pytest.mark.parametrize("name", EXPECT)
def test_serve_app_builds_and_serve_applies_the_deployment_options(name):
    """The import_path imports, the application builds from the repo's copy of args.config, and Serve's own
    override of the code's deployment options (what its controller does with serveConfigV2) accepts the
    manifest's deployments; a deployment name the app lacks is refused the same way."""
    from ray.serve._private.application_state import override_deployment_info
    from ray.serve._private.build_app import build_app
    from ray.serve._private.deployment_info import DeploymentInfo
    from ray.serve._private.utils import import_attr
    from ray.serve.schema import ServeDeploySchema

    doc = RAYSERVICES[name]
    app_schema = ServeDeploySchema.model_validate(rules.serve_config(doc)).applications[0]
    builder = import_attr(app_schema.import_path)
    built = build_app(builder(app_schema.args), name=app_schema.name, default_runtime_env={})
    infos = {d.name: DeploymentInfo(deployment_config=d._deployment_config, replica_config=d._replica_config,
                                    start_time_ms=0, deployer_job_id="") for d in built.deployments}
    auto = _cfg(doc).cluster.autoscaling                     # the code's options, from the config file
    built_cfg = infos["SpecServe"].deployment_config
    if auto is not None:
        assert built_cfg.autoscaling_config.max_replicas == auto.max_units
        assert built_cfg.autoscaling_config.min_replicas == auto.min_units
    else:
        assert built_cfg.num_replicas == _cfg(doc).cluster.replicas
    result = override_deployment_info(infos, app_schema)
    for dep in rules.serve_config(doc)["applications"][0].get("deployments", []):
        got = result[dep["name"]].deployment_config
        if "autoscaling_config" in dep:
            assert got.num_replicas is None
            for k, v in dep["autoscaling_config"].items():
                assert getattr(got.autoscaling_config, k) == v, k
    unknown = app_schema.model_copy(update={"deployments": [
        app_schema.deployments[0].model_copy(update={"name": "Nope"}) if app_schema.deployments else
        type(app_schema).model_fields["deployments"].annotation.__args__[0](name="Nope")]})
    with pytest.raises(ValueError, match="Nope"):
        override_deployment_info(infos, unknown)


@pytest.mark.parametrize("name", EXPECT)
def test_serve_config_is_what_specserve_generates(name):
    """serveConfigV2 is exactly `specserve serve-config --config configs/X --inline`: one deploy description,
    the config file inline (the manifest and configs/ in step); units, autoscaling and drain time come from the
    config (no `deployments` override)."""
    doc = RAYSERVICES[name]
    sc = rules.serve_config(doc)
    path = rules.repo_config_path(sc)
    file_data = yaml.safe_load(path.read_text())
    assert sc["applications"][0]["args"]["config"] == file_data, f"{name}: inline config differs from {path}"
    assert sc == serve_config(load_config(path), f"configs/{path.name}", inline=file_data)


def test_an_edit_of_the_inline_config_changes_what_serve_deploys():
    """No image involved: the application builder reads the config from serveConfigV2's args."""
    from ray.serve._private.build_app import build_app
    from ray.serve._private.utils import import_attr
    args = rules.serve_config(RAYSERVICES["rayservice-cpu.yaml"])["applications"][0]["args"]
    builder = import_attr("cluster.serving.fronts.app:app_builder")
    limits = []
    for max_batch in (16, 3):
        edited = copy.deepcopy(args)
        edited["config"]["engine"]["max_batch"] = max_batch
        (dep,) = build_app(builder(edited), name="specserve", default_runtime_env={}).deployments
        limits.append(dep._deployment_config.max_ongoing_requests)
    assert limits[0] - limits[1] == 16 - 3
