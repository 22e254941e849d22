"""Build the in-process worker for ONE model of a config (what an actor hosts).

Mirrors :func:`cluster.loader.load_models` for a single model so an actor loads only its own model.
With ``tp_size > 1`` the checkpoint is loaded through transformers' own tensor-parallel plan
(``DistributedConfig(tp_size=N)`` = the model's ``base_model_tp_plan``, e.g. Llama's colwise q/k/v/
gate/up and rowwise o/down projections, ``lm_head`` gathered); ``torch.distributed`` must already be
initialised by the caller (:mod:`actors.tp`).  Tiny models are built, saved to a temporary directory
and loaded from there, so the TP path is the same checkpoint path a real model takes.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from cluster.config import Config
from cluster.worker import HFWorker


def _tiny_model(cfg: Config, name: str):
    from cluster.tiny import tiny_llama, truncated
    spec = cfg.models[name].tiny
    if spec.truncate is None:
        return tiny_llama(hidden=spec.hidden, layers=spec.layers, heads=spec.heads, seed=spec.seed,
                          max_position=spec.max_position)
    t = cfg.models[cfg.target].tiny
    base = tiny_llama(hidden=t.hidden, layers=t.layers, heads=t.heads, seed=t.seed, max_position=t.max_position)
    return truncated(base, spec.truncate)


def checkpoint_dir(cfg: Config, name: str) -> Path:
    """A local HF checkpoint directory for model ``name`` (tiny models are saved to a temp dir)."""
    from cluster.loader import model_path
    spec = cfg.models[name]
    if spec.tiny is None:
        return model_path(cfg, spec, build=False)
    out = Path(tempfile.mkdtemp(prefix=f"specserve-{name}-"))
    _tiny_model(cfg, name).save_pretrained(out)
    return out


def build_worker(cfg: Config, name: str, *, tp_size: int = 1, device: str | None = None) -> HFWorker:
    """The :class:`HFWorker` for ``name``; sharded over the current process group when ``tp_size > 1``."""
    spec = cfg.models[name]
    device = device or spec.device
    if tp_size > 1:
        from transformers.distributed import DistributedConfig
        return HFWorker.from_pretrained(checkpoint_dir(cfg, name), name, dtype=spec.dtype, device=device,
                                        distributed_config=DistributedConfig(tp_size=tp_size))
    if spec.tiny is not None:
        return HFWorker(_tiny_model(cfg, name).to(getattr(torch, spec.dtype)), name)
    worker = HFWorker.from_pretrained(checkpoint_dir(cfg, name), name, dtype=spec.dtype, device=device)
    if spec.zoo is not None:                     # as cluster.loader: the zoo's SpecDec++ acceptance head
        from cluster.loader import zoo_dir
        head = zoo_dir(cfg, build=False) / "specdec-head" / spec.zoo
        if (head / "head.json").is_file():
            worker.specdec_head = str(head)
    return worker
