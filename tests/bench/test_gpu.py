"""The gpu suite: refused with a clear message where no CUDA device is visible, its device checked, and the whole
in-process procedure (greedy exactness alone and batched, forward costs) on the CPU with ``--device cpu``."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from cluster.bench import SUITES, gpu
from cluster.config.schema import load_config
from cluster.errors import ParamError
from cluster.family import ensure_built

NEW = 8


def _args(tmp_path, **kw):
    base = dict(prompts="3", max_new_tokens=str(NEW), temperature="0", out=str(tmp_path), runtime="in-process",
                device=None)
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


def test_on_device_moves_every_model_and_asks_ray_for_a_share_of_the_gpu():
    cfg = load_config("configs/local.yaml")
    moved = gpu.on_device(cfg, "cuda")
    assert {s.device for s in moved.models.values()} == {"cuda"}
    assert moved.cluster.coordinator.num_gpus == moved.cluster.drafters.num_gpus == gpu.GPU_SHARE
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
