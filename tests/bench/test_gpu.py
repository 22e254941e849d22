"""The gpu suite: refused with a clear message where no CUDA device is visible, its device checked, and the whole
in-process procedure (greedy exactness alone and batched, forward costs) on the CPU with ``--device cpu``."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from cluster.bench import SUITES, gpu, gpu_shapes, projection
from cluster.bench.measure import forward_cost_grid
from cluster.config.schema import load_config
from cluster.core.interfaces import PerRequestHandle
from cluster.errors import ParamError
from cluster.family import ensure_built

NEW = 8


def _args(tmp_path, **kw):
    base = dict(prompts="3", max_new_tokens=str(NEW), temperature="0", out=str(tmp_path), runtime="in-process",
                device=None, concurrency="1,2")
    return argparse.Namespace(**{**base, **kw})


def test_without_a_device_it_stops_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert SUITES["gpu"] is gpu.run
    assert gpu.run(_args(tmp_path), load_config("configs/tiny.yaml")) == 2
    assert "no CUDA device" in capsys.readouterr().out and not list(tmp_path.iterdir())
    with pytest.raises(ParamError, match="device"):
        gpu.run(_args(tmp_path, device="cuda"), load_config("configs/tiny.yaml"))
    with pytest.raises(ParamError, match="device"):
        gpu.run(_args(tmp_path, device="tpu"), load_config("configs/tiny.yaml"))


def test_the_served_half_without_ray_stops_before_measuring(tmp_path, monkeypatch, capsys):
    """A lent device's image may have torch but not Ray: the served half says what is missing up front."""
    real = gpu.importlib.util.find_spec
    monkeypatch.setattr(gpu.importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert gpu.run(_args(tmp_path, device="cpu", runtime="in-process,cluster"), load_config("configs/tiny.yaml")) == 2
    out = capsys.readouterr().out
    assert "needs Ray and Ray Serve" in out and "--runtime in-process" in out and not list(tmp_path.iterdir())


def test_on_device_moves_every_model_and_asks_ray_for_a_share_of_the_gpu():
    cfg = load_config("configs/local.yaml")
    moved = gpu.on_device(cfg, "cuda")
    assert {s.device for s in moved.models.values()} == {"cuda"}
    assert moved.cluster.coordinator.num_gpus == moved.cluster.drafters.num_gpus == gpu.GPU_SHARE
    assert moved.cluster.placement()[0] == "colocated"       # a share of the target's device is not one of its own
    assert gpu.on_device(cfg, "cpu").cluster == cfg.cluster


def test_the_procedure_on_the_cpu(tmp_path):
    cfg = load_config("configs/tiny.yaml")
    ensure_built(cfg, progress=False)
    assert gpu.run(_args(tmp_path, device="cpu"), cfg) == 0
    equal = json.loads((tmp_path / "gpu_exactness.json").read_text())
    assert [r["strategy"] for r in equal][0] == "autoregressive" and len(equal) >= 2
    for r in equal:
        assert r["equal_alone"] == r["equal_batched"] == r["prompts"] == 3, r
        assert r["tokens"] == 3 * NEW and r["tok_s"] > 0
    costs = json.loads((tmp_path / "gpu_forward_costs.json").read_text())
    target = {(r["rows"], r["tokens"]): r for r in costs if r["model"] == cfg.target}
    assert set(target) == {(b, t) for b in gpu.COST_ROWS for t in gpu.COST_TOKENS}
    assert all(r["c_vs_target"] == 1.0 for (_, t), r in target.items() if t == 1)
    drafters = {r["model"] for r in costs} - {cfg.target}
    assert drafters == set(cfg.drafters) and all(r["ms"] > 0 for r in costs)
    load = json.loads((tmp_path / "bench_load.json").read_text())      # the load step, in-process on the device
    assert {r["concurrency"] for r in load} == {1, 2}
    assert {r["strategy"] for r in load} >= {"autoregressive", "speculative k=4"}, load


class SingleFormHandle(PerRequestHandle):
    """A handle written in per-request forms (batched by the one adapter): the forward-cost grid drives it."""

    def __init__(self):
        self.name, self.vocab_size, self.max_length, self.deterministic = "m", 16, 64, False
        self.live: dict[str, int] = {}
        self.scored = 0

    def prefill(self, rid, ids, sampling, seed):
        self.live[rid] = len(ids)

    def score(self, rid, draft):
        assert rid in self.live
        self.scored += 1

    def rollback(self, rid, length):
        self.live[rid] = length

    def extend(self, rid, ids):
        self.live[rid] += len(ids)

    def release(self, rid):
        self.live.pop(rid, None)


def test_the_forward_cost_grid_times_every_cell_and_releases_its_rows():
    h = SingleFormHandle()
    grid = forward_cost_grid(h, rows=(1, 3), new_tokens=(1, 2), context=8, iters=2)
    assert set(grid) == {(1, 1), (1, 2), (3, 1), (3, 2)} and all(v >= 0 for v in grid.values())
    assert h.scored == (1 + 3) * 2 * 3 and h.live == {}            # 2 iterations + 1 warm-up per cell


TINY_SHAPES = {name: dict(shape, hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
                          head_dim=16, num_attention_heads=4, num_key_value_heads=2)
               for name, shape in gpu_shapes.SHAPES.items()}


def test_production_shapes_are_timed_per_cell_and_become_the_projections_inputs():
    rows = gpu_shapes.shape_costs("cpu", TINY_SHAPES, rows=(1, 32), tokens=(1, 5), context=8, iters=2, warmup=1,
                                  dtype=torch.float32)
    assert [(r["shape"], r["rows"], r["tokens"]) for r in rows] == [
        (s, r, t) for s in TINY_SHAPES for r in (1, 32) for t in (1, 5)]
    assert all(r["ms"] > 0 for r in rows) and rows[0]["vs_1x1"] == 1.0
    inputs = gpu_shapes.projection_inputs(rows)
    assert set(inputs) <= set(projection.INPUTS)
    ms = {(r["shape"], r["rows"], r["tokens"]): r["ms"] for r in rows}
    t1 = ms[("target-tp8-rank", 1, 1)] + gpu_shapes.ALLREDUCE_MS
    assert inputs["target_ms"] == pytest.approx(t1, abs=1e-3)
    assert inputs["draft_batch32_factor"] == pytest.approx(ms[("drafter-1b", 32, 1)] / ms[("drafter-1b", 1, 1)],
                                                           rel=1e-2)
    plain = next(r for r in projection.project(inputs, batches=(1,)) if r["strategy"] == "autoregressive")
    assert plain["step_ms"] == pytest.approx(inputs["target_ms"], abs=0.01)      # priced by the measured costs


def test_a_70b_rank_and_a_1b_drafter_have_the_sizes_they_stand_for():
    """The shapes are what they claim, counted on the meta device (no memory): a 70B target's rank is about an
    eighth of 70.6B parameters, the drafter about 1.24B (Llama-3.2-1B)."""
    sizes = {}
    for name, shape in gpu_shapes.SHAPES.items():
        with torch.device("meta"):
            model = gpu_shapes.LlamaForCausalLM(gpu_shapes.LlamaConfig(**shape))
        sizes[name] = sum(p.numel() for p in model.parameters())
    assert 8.3e9 < sizes["target-tp8-rank"] < 9.0e9      # 70.6e9 / 8 = 8.8e9 (embeddings not sharded: +)
    assert 1.2e9 < sizes["drafter-1b"] < 1.3e9


def test_the_static_cache_path_times_the_same_cells():
    rows = gpu_shapes.shape_costs("cpu", TINY_SHAPES, rows=(1, 32), tokens=(1, 5), context=8, iters=2, warmup=1,
                                  dtype=torch.float32, graphed=True)
    assert all(r["graphed_ms"] > 0 for r in rows)
    eager, graphed = gpu_shapes.projection_inputs(rows), gpu_shapes.projection_inputs(rows, column="graphed_ms")
    assert set(eager) == set(graphed) and eager != graphed
