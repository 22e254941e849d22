"""Cluster pieces that need no Ray: remote handles (one round trip per model per step), configs,
generated stubs, the KubeRay manifest, OpenAI request parsing."""
from __future__ import annotations

import dataclasses
import filecmp
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from cluster.config.schema import config_from_dict, load_config
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ConfigError, ParamError
from cluster.serving.control.channel import Channel
from tests.support.exact import local_engine

ROOT = Path(__file__).resolve().parents[2]


class InProcessChannel(Channel):
    """A transport that is no Ray: the channel seam over an actor body (ModelHost, DraftHost) in this process.
    The remote handle, unchanged, drives it; it records each call's method and ops."""

    def __init__(self, host):
        self.actors, self.calls = [host], []

    def call(self, step):
        self.calls.append((step.method, [op for op, _, _ in step.ops]))
        return self.actors[0].step(step)

    def ask(self, question):
        answer = [getattr(self.actors[0], question)()]
        return SimpleNamespace(wait=lambda timeout_s: answer)

    def probe(self):
        return True

    def active_requests(self):
        return self.actors[0].active_requests()


@pytest.fixture(scope="module")
def remote_engine(tiny_engine):
    """The engine over RemoteHandles whose endpoints call ModelHosts (actor bodies) in this process."""
    from actors.model_actor import ModelHost
    from cluster.serving.control.remote import RemoteHandle
    cfg = load_config("configs/tiny.yaml")
    eps = {n: InProcessChannel(ModelHost(cfg, n)) for n in cfg.models}
    handles = {n: RemoteHandle(ep, ep.actors[0].info()) for n, ep in eps.items()}
    return local_engine(handles, tiny_engine.tokenizer, target=cfg.target, defaults=cfg.engine.options), eps


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
        scores = [m for m, _ in eps["target"].calls if m in ("score_batch", "verify_batch")]
        assert scores and len(scores) == got.stats.target_forwards
        for n, ep in eps.items():
            assert all(m is not None or ops[-1:] == ["release"] for m, ops in ep.calls)   # ops alone: a release
            assert not ep.active_requests()
            ep.calls.clear()


@pytest.fixture(scope="module")
def grouped_engine(tiny_engine):
    """The separated layout without Ray: the target's ModelHost and the draft-group actor's body (DraftHost, every
    drafter and MaG, pre-drafting in its background thread) behind RemoteHandles, as build_unit connects them."""
    from actors.draft_actor import DraftHost
    from actors.model_actor import ModelHost
    from cluster.core.draft.programs import DRAFTS
    from cluster.family import ensure_built
    from cluster.serving.control.remote import RemoteHandle
    data = yaml.safe_load(open(ROOT / "configs" / "tiny.yaml"))
    data["mag"], data["suffix"] = {}, {}
    cfg = config_from_dict(data)
    ensure_built(cfg, progress=False)
    target = InProcessChannel(ModelHost(cfg, cfg.target))
    group = InProcessChannel(DraftHost(cfg, cfg.drafters, overlap=True))
    info = group.actors[0].info()
    handles = {cfg.target: RemoteHandle(target, target.actors[0].info()), DRAFTS: RemoteHandle(group, info)}
    handles.update({n: RemoteHandle(group, mi, member=n) for n, mi in info["members"].items()})
    return cfg, local_engine(handles, tiny_engine.tokenizer, target=cfg.target, defaults=cfg.engine.options), target, group


@pytest.mark.parametrize("strategy,options", [("speculative", {}), ("mag", {}), ("cs_drafting", {}),
                                              ("specdec_pp", {"threshold": 0.3}), ("spec_cascade", {}),
                                              ("suffix", {}), ("cs_drafting", {"drafters": "drafter-small,suffix"})])
def test_draft_group_one_call_per_step_whatever_the_cascade(tiny_engine, grouped_engine, strategy, options):
    """Drafting strategies cost one draft-side call per target forward (CS Drafting too, whose cascade makes
    several drafter calls inside the group); greedy output equals autoregressive, pre-drafted blocks included;
    greedy blocks travel as token ids only; a strategy that drives one drafter (speculative cascades) reaches
    it as a member of the group; nothing is left on any model."""
    from actors.protocol import StepCall
    cfg, engine, target, group = grouped_engine
    host = group.actors[0]
    base = dict(prompt_ids=list(b"import os\nimport sys\nimport os\n"), max_new_tokens=40,
                sampling=SamplingParams(0.0), seed=4, ignore_eos=True)
    lossy = strategy == "spec_cascade"                # its own law: the in-process engine's output instead
    want = tiny_engine.generate(GenerationRequest(strategy=strategy if lossy else "autoregressive",
                                                  options=options if lossy else {}, **base)).token_ids
    if strategy == "specdec_pp" and not engine.models["drafter-large"].__dict__.get("specdec_head"):
        options = dict(options, head=None)
    try:
        got = engine.generate(GenerationRequest(strategy=strategy, options=options, **base))
    except ParamError:                                 # tiny drafters carry no SpecDec++ head
        assert strategy == "specdec_pp"
        return
    assert got.token_ids == want
    drafts = [m for m, _ in group.calls if m == "draft_batch"]
    scores = [m for m, _ in target.calls if m in ("score_batch", "verify_batch")]
    if strategy in ("speculative", "mag", "cs_drafting", "suffix"):
        assert 0 < len(drafts) <= len(scores) == got.stats.target_forwards
        assert all(m in ("draft_batch", "prefill_batch", None) for m, _ in group.calls)
        assert engine.models["@drafts"].timing.bytes_in <= 8 * 64 * len(drafts)     # token ids, no logits
    host._join()
    assert not target.active_requests() and not host.side.active_requests()
    assert all(not h.active_requests() for h in host.side.members.values())
    if strategy in ("speculative", "mag", "cs_drafting", "suffix"):   # next blocks were pre-drafted (used or dropped)
        assert host.side.hits + host.side.misses + host.given_up > 0
    target.calls.clear()
    group.calls.clear()
    assert isinstance(host.step(StepCall()), tuple)


def test_topology_auto_follows_the_draft_sides_device():
    """``auto`` (the default): the draft side in its own actor where it has a whole device (GPU); where it would
    share CPU cores or a fraction of the target's device, the drafters in the coordinator; a named topology is
    kept."""
    from cluster.config.layout import ActorResources, ClusterSpec
    assert ClusterSpec().topology == "auto"
    assert ClusterSpec().placement()[0] == "colocated" and "no device" in ClusterSpec().placement()[1]
    gpu = ClusterSpec(drafters=ActorResources(num_gpus=1))
    assert gpu.placement()[0] == "separated"
    shared = ClusterSpec(drafters=ActorResources(num_gpus=0.25))       # a share of a device is not one of its own
    assert shared.placement()[0] == "colocated" and "num_gpus = 0.25" in shared.placement()[1]
    assert ClusterSpec(topology="separated").placement() == ("separated", "named in the config")
    shipped = load_config(ROOT / "configs" / "local.yaml").cluster        # auto: colocated on this CPU
    assert shipped.topology == "auto" and shipped.placement()[0] == "colocated"


def test_configs_cluster_sections():
    for name in ("tiny", "local", "production-70b"):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        cfg.cluster.validate("cluster")
    prod = load_config(ROOT / "configs" / "production-70b.yaml")
    assert prod.cluster.tp_size == 8 and prod.cluster.tp_backend() == "nccl"
    assert prod.cluster.target.num_gpus == 1 and prod.models["target"].device == "cuda"


@pytest.mark.parametrize("section,words", [
    ({"topology": "mesh"}, ["cluster.topology", "auto, separated, colocated, speculator", "mesh"]),
    ({"draft_channel": "grpc"}, ["cluster.draft_channel", "ray, socket", "grpc"]),
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
    ({"autoscaling": {"look_back_period_s": 5}}, ["cluster.autoscaling.look_back_period_s", "> 10", "5"]),
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

    from cluster.serving.ops.deploy import deployment_options, serve_config
    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data["cluster"].update(autoscaling={"min_units": 1, "max_units": 3, "upscale_delay_s": 2,
                                        "downscale_delay_s": 5}, drain_timeout_s=30)
    cfg = config_from_dict(data)
    opts = deployment_options(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                               # Serve's FutureWarnings too
        auto = AutoscalingConfig(**opts["autoscaling_config"])      # Serve's own validation
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
    ({"prompt": "x", "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ([1, 2], "body"),
])
def test_openai_request_errors_name_the_field(body, name, tiny_engine):
    from cluster.serving.fronts.completions import fields_from_openai
    from cluster.serving.fronts.requests import prepare
    cfg = load_config("configs/tiny.yaml")
    coord = SimpleNamespace(engine=tiny_engine, prepare=tiny_engine.prepare)
    with pytest.raises(ParamError) as e:
        prepare(coord, cfg, fields_from_openai(body)[0])
    assert e.value.name == name


def test_openai_request_defaults_from_config():
    from cluster.serving.fronts.completions import fields_from_openai
    from cluster.serving.fronts.requests import build_request
    cfg = load_config("configs/tiny.yaml")
    fields, m = fields_from_openai({"prompt": ["hi"], "stop": "\n", "top_k": 5,
                                    "strategy": "speculative", "options": {"k": 3}})
    req = build_request(cfg, fields)
    assert not m.stream and req.prompt == "hi" and req.stop == ("\n",)
    assert req.max_new_tokens == cfg.generation.max_new_tokens
    assert req.sampling == dataclasses.replace(cfg.generation.sampling(), top_k=5)
    assert req.options == {"k": 3}


def test_remote_prefill_items_carry_the_cache_salt():
    """A remote handle sends prefill items as PrefillItems: a salt reaches the hosted handle, a 4-tuple arrives
    unsalted, and the hosted handle's answer comes back."""
    from actors.protocol import StepTime, apply
    from cluster.core.calls import PrefillItem
    from cluster.serving.control.remote import RemoteHandle
    from tests.support.exact import TabularModel

    class Hosted(TabularModel):
        def prefill_batch(self, items):
            self.got = list(items)
            super().prefill_batch(items)
            return [len(it.ids) for it in items]

    hosted = Hosted("m", 4, seed=0)

    class Host:
        def step(self, call):
            return apply(hosted, call), StepTime(0.0)

        def info(self):
            return hosted.capabilities()

    remote = RemoteHandle(InProcessChannel(Host()), hosted.capabilities())
    sp = SamplingParams(0.0)
    assert remote.prefill_batch([PrefillItem("a", (0, 1), sp, 0, "tenant-a"), ("b", [2], sp, 0)]) == [2, 1]
    assert hosted.got == [PrefillItem("a", [0, 1], sp, 0, "tenant-a"), PrefillItem("b", [2], sp, 0, "")]
    assert all(type(it) is PrefillItem for it in hosted.got) and sorted(hosted.seqs) == ["a", "b"]
