"""The in-process runtime: config -> model handles -> engine (CLI, tests, benchmarks).

One of the two composition roots (the other is :mod:`cluster.serving.control.unit`, on Ray).
"""
from __future__ import annotations

from cluster.config.schema import Config
from cluster.core.model_set import ModelSet
from cluster.engine.engine import Engine
from cluster.models.build import build_handles, load_tokenizer


def build_engine(cfg: Config) -> Engine:
    """An in-process :class:`Engine` over every model of ``cfg`` (built first with
    :func:`cluster.family.ensure_built` where it uses the embedded family or a bigram table)."""
    models = ModelSet.assemble(build_handles(cfg), cfg.target, overlap=cfg.engine.overlap_on(draft_side_remote=False))
    return Engine.configured(models, load_tokenizer(cfg), cfg.engine)
