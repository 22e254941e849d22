"""The in-process runtime: config -> model handles -> engine (CLI, tests, benchmarks).

One of the two composition roots (the other is :mod:`cluster.serving.control.unit`, on Ray).
"""
from __future__ import annotations

from cluster.config.schema import Config
from cluster.core.model_set import ModelSet
from cluster.engine.engine import Engine
from cluster.engine.measure import build_planner
from cluster.models.build import build_handles, load_tokenizer


def build_engine(cfg: Config, *, planner: bool | None = None) -> Engine:
    """An in-process :class:`Engine` over every model of ``cfg`` (built first with
    :func:`cluster.family.ensure_built` where it uses the embedded family or a bigram table).

    The engine always has the load-aware planner (:func:`cluster.engine.measure.build_planner`, as on the
    cluster), so a request's ``plan=load_aware`` is honoured whatever the config's default.  ``planner``:
    measure its forward costs now (True), on the first step that plans (False), or now exactly when the
    config's default options ask for it, ``engine.options.plan: load_aware`` (None)."""
    models = ModelSet.assemble(build_handles(cfg), cfg.target, overlap=cfg.engine.overlap_on(draft_side_remote=False))
    plan = build_planner(models.handles, cfg.target, cfg.drafters, cfg.engine, measure_now=planner)
    return Engine.configured(models, load_tokenizer(cfg), cfg.engine, planner=plan)
