"""Cluster pieces that need no Ray: remote handles (one round trip per model per step), configs,
generated stubs, the KubeRay manifest, OpenAI request parsing."""
from __future__ import annotations

import dataclasses
import filecmp
from pathlib import Path

import pytest
import yaml

from cluster.config.schema import config_from_dict, load_config
from cluster.core.sampling import SamplingParams
from cluster.engine.engine import Engine
from cluster.engine.request import GenerationRequest
from cluster.errors import ConfigError, ParamError

ROOT = Path(__file__).resolve().parents[2]


class InProcessEndpoint:
    """The actor endpoint interface over a ModelHost in this process (what Ray would call)."""

    def __init__(self, host):
        self.actors, self.calls = [host], []

    def step(self, call):
        self.calls.append((call.method, [op for op, _, _ in call.ops]))
        return self.actors[0].step(call)

    def active_requests(self):
        return self.actors[0].active_requests()


@pytest.fixture(scope="module")
def remote_engine(tiny_engine):
    """The engine over RemoteHandles whose endpoints call ModelHosts (actor bodies) in this process."""
    from actors.model_actor import ModelHost
    from cluster.serving.remote import RemoteHandle
    cfg = load_config("configs/tiny.yaml")
    eps = {n: InProcessEndpoint(ModelHost(cfg, n)) for n in cfg.models}
    handles = {n: RemoteHandle(ep, ep.actors[0].info()) for n, ep in eps.items()}
    return Engine(handles, tiny_engine.tokenizer, target=cfg.target, defaults=cfg.engine.options), eps


def _strategies():
    from cluster.strategies import REGISTRY
    return sorted(REGISTRY)


@pytest.mark.parametrize("strategy", _strategies())
def test_remote_handles_match_in_process_with_one_call_per_model_per_step(tiny_engine, remote_engine, strategy):
    """Every strategy runs unchanged over remote handles: one call per model per forward (the target's equal
    its forward passes), queued rollback/extend ride along, only a release is sent on its own."""
    engine, eps = remote_engine
    for temperature in (0.0, 1.0):
        req = GenerationRequest(prompt_ids=list(b"import os\n"), max_new_tokens=30,
                                sampling=SamplingParams(temperature), seed=4, strategy=strategy)
        try:
            want = tiny_engine.generate(req)
        except ParamError as err:              # not servable on this config: refused alike
            with pytest.raises(ParamError) as e:
                engine.generate(req)
            assert str(e.value) == str(err)
            return
        got = engine.generate(req)
        assert got.token_ids == want.token_ids
        scores = [m for m, _ in eps["target"].calls if m == "score_batch"]
        assert scores and len(scores) == got.stats.target_forwards
        for n, ep in eps.items():
            assert all(m is not None or ops[-1:] == ["release"] for m, ops in ep.calls)   # ops alone: a release
            assert not ep.active_requests()
            ep.calls.clear()


def test_configs_cluster_sections():
    for name in ("tiny", "local", "production-70b"):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        cfg.cluster.validate("cluster")
    prod = load_config(ROOT / "configs" / "production-70b.yaml")
    assert prod.cluster.tp_size == 8 and prod.cluster.tp_backend() == "nccl"
    assert prod.cluster.target.num_gpus == 1 and prod.models["target"].device == "cuda"


@pytest.mark.parametrize("section,words", [
    ({"topology": "mesh"}, ["cluster.topology", "mesh"]),
    ({"tp_size": 0}, ["cluster.tp_size", "[1, 1024]", "0"]),
    ({"backend": "mpi"}, ["cluster.backend", "mpi"]),
    ({"target": {"num_cpus": -1}}, ["cluster.target.num_cpus", "-1"]),
    ({"tp_size": 2, "backend": "nccl"}, ["cluster.backend", "num_gpus"]),
    ({"grpc_port": 8000, "http_port": 8000}, ["cluster.grpc_port", "8000"]),
    ({"warmup_tokens": -1}, ["cluster.warmup_tokens", "-1"]),
    ({"replicaz": 2}, ["cluster.replicaz", "unknown field"]),
    ({"autoscaling": {"min_units": 0}}, ["cluster.autoscaling.min_units", "[1, 1024]", "0"]),
    ({"autoscaling": {"min_units": 2, "max_units": 1}}, ["cluster.autoscaling.max_units", "min_units=2", "1"]),
    ({"autoscaling": {"max_units": 3, "initial_units": 4}}, ["cluster.autoscaling.initial_units", "4"]),
    ({"autoscaling": {"target_ongoing_requests": 0}}, ["cluster.autoscaling.target_ongoing_requests", "> 0"]),
    ({"autoscaling": {"upscale_delay_s": -1}}, ["cluster.autoscaling.upscale_delay_s", "-1"]),
    ({"autoscaling": {"max_unitz": 3}}, ["cluster.autoscaling.max_unitz", "unknown field"]),
    ({"autoscaling": {"max_units": 3}, "replicas": 2}, ["cluster.replicas", "initial_units", "2"]),
    ({"drain_timeout_s": -1}, ["cluster.drain_timeout_s", "-1"]),
])
def test_bad_cluster_config_names_field(section, words):
    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data["cluster"] = section
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_autoscaling_maps_onto_serve_and_one_serve_config_deploys_it():
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    from cluster.serving.deploy import deployment_options, serve_config
    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data["cluster"].update(autoscaling={"min_units": 1, "max_units": 3, "upscale_delay_s": 2,
                                        "downscale_delay_s": 5}, drain_timeout_s=30)
    cfg = config_from_dict(data)
    opts = deployment_options(cfg)
    auto = AutoscalingConfig(**opts["autoscaling_config"])          # Serve's own validation
    assert (auto.min_replicas, auto.max_replicas, auto.initial_replicas) == (1, 3, 1)
    assert auto.target_ongoing_requests == cfg.engine.max_batch and auto.upscale_delay_s == 2
    assert "num_replicas" not in opts and opts["graceful_shutdown_timeout_s"] == 30
    fixed = deployment_options(load_config(ROOT / "configs" / "tiny.yaml"))
    assert fixed["num_replicas"] == 1 and "autoscaling_config" not in fixed
    sc = serve_config(cfg, "/app/configs/tiny.yaml")
    ServeDeploySchema.model_validate(sc)                            # what `serve deploy` / KubeRay accept
    assert sc["applications"][0]["args"] == {"config": "/app/configs/tiny.yaml"}
    assert "deployments" not in sc["applications"][0]              # options come from the config, once


def test_generated_stubs_are_up_to_date(tmp_path):
    from protos.build import build
    for path in build(tmp_path):
        assert filecmp.cmp(path, ROOT / "protos" / path.name, shallow=False), \
            f"protos/{path.name} is stale: run python -m protos.build"


@pytest.mark.parametrize("body,name", [
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ([1, 2], "body"),
])
def test_openai_request_errors_name_the_field(body, name):
    from cluster.serving.http_api import request_from_openai
    cfg = load_config("configs/tiny.yaml")
    with pytest.raises(ParamError) as e:
        request_from_openai(body, cfg)
    assert e.value.name == name


def test_openai_request_defaults_from_config():
    from cluster.serving.http_api import request_from_openai
    cfg = load_config("configs/tiny.yaml")
    req, stream = request_from_openai({"prompt": ["hi"], "stop": "\n", "top_k": 5,
                                       "strategy": "speculative", "options": {"k": 3}}, cfg)
    assert not stream and req.prompt == "hi" and req.stop == ("\n",)
    assert req.max_new_tokens == cfg.generation.max_new_tokens
    assert req.sampling == dataclasses.replace(cfg.generation.sampling(), top_k=5)
    assert req.options == {"k": 3}
