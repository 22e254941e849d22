"""Test-side entry point: build what a config needs (as the CLI does), then the in-process engine."""
from __future__ import annotations

from cluster.config.schema import Config
from cluster.engine.engine import Engine
from cluster.family import ensure_built
from cluster.local import build_engine


def engine_for(cfg: Config) -> Engine:
    ensure_built(cfg, progress=False)
    return build_engine(cfg)
