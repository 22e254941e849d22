"""The in-process runtime: config -> model handles -> engine (CLI, tests, benchmarks).

One of the two composition roots (the other is :mod:`cluster.serving.unit`, on Ray).
"""
from __future__ import annotations

from cluster.config.schema import Config
from cluster.engine.engine import Engine
from cluster.models.build import build_handles, load_tokenizer


def build_engine(cfg: Config) -> Engine:
    """An in-process :class:`Engine` over every model of ``cfg`` (built first with
    :func:`cluster.family.ensure_built` where it uses the embedded family or a bigram table)."""
    return Engine(build_handles(cfg), load_tokenizer(cfg), target=cfg.target, default_strategy=cfg.engine.strategy,
                  defaults=cfg.engine.options, max_new_tokens_limit=cfg.engine.max_new_tokens_limit)
