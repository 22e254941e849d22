"""The in-process runtime: config -> model handles -> engine (CLI, tests, benchmarks).

One of the two composition roots (the other is :mod:`cluster.serving.control.unit`, on Ray).
"""
from __future__ import annotations

from cluster.config.schema import Config
from cluster.core.draft.near_far import LocalLink, NearFarSide
from cluster.core.draft.programs import DRAFTS
from cluster.core.draft.side import DraftSide
from cluster.core.draft.speculator import Speculator
from cluster.core.model_set import ModelSet
from cluster.engine.engine import Engine
from cluster.engine.measure import build_planner
from cluster.models.build import build_handles, load_tokenizer


def build_engine(cfg: Config, *, planner: bool | None = None, extra: dict | None = None,
                 speculator: bool = False) -> Engine:
    """An in-process :class:`Engine` over every model of ``cfg`` (built first with
    :func:`cluster.family.ensure_built` where it uses the embedded family or a bigram table).

    The engine always has the load-aware planner (:func:`cluster.engine.measure.build_planner`, as on the
    cluster), so a request's ``plan=load_aware`` is honoured whatever the config's default.  ``planner``:
    measure its forward costs now (True), on the first step that plans (False), or now exactly when the
    config's default options ask for it, ``engine.options.plan: load_aware`` (None).  ``extra``: more
    in-process drafter handles beside the config's (a benchmark's variant of one).  ``speculator``: the draft side
    is the ``speculator`` topology's near-far side with its speculator (its own copies of the drafters) in this
    process, answering every fill before the next step (:class:`cluster.core.draft.near_far.LocalLink`: the
    speculation cache's hits when no answer is late; it drafts inside the step, so its speed means nothing)."""
    handles = {**build_handles(cfg), **(extra or {})}
    if speculator:
        drafters = {n: h for n, h in handles.items() if n != cfg.target}
        far = Speculator(build_handles(cfg, list(drafters)))
        handles[DRAFTS] = NearFarSide(DraftSide(drafters), LocalLink(far))
    models = ModelSet.assemble(handles, cfg.target, overlap=cfg.engine.overlap_on(draft_side_remote=False))
    plan = build_planner(models.handles, cfg.target, cfg.drafters, cfg.engine, measure_now=planner)
    return Engine.configured(models, load_tokenizer(cfg), cfg.engine, planner=plan)
