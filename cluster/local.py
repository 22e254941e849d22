"""The in-process runtime: config -> model handles -> engine (CLI, tests, benchmarks).

One of the two composition roots (the other is :mod:`cluster.serving.unit`, on Ray).
"""
from __future__ import annotations

from cluster.config.schema import Config
from cluster.core.cost_model import ForwardCost
from cluster.core.interfaces import ModelHandle
from cluster.engine.engine import Engine
from cluster.engine.planner import Planner
from cluster.models.batched import forward_cost_grid
from cluster.models.build import build_handles, load_tokenizer


def build_engine(cfg: Config, *, planner: bool | None = None) -> Engine:
    """An in-process :class:`Engine` over every model of ``cfg`` (built first with
    :func:`cluster.family.ensure_built` where it uses the embedded family or a bigram table).

    ``planner``: attach a measured load-aware :class:`Planner` (True), none (False), or one exactly when the
    config's default options ask for it, ``engine.options.plan: load_aware`` (None)."""
    handles = build_handles(cfg)
    # -- load-aware planner (see cluster/engine/planner.py) --
    if planner is None:
        planner = cfg.engine.options.get("plan") == "load_aware"
    plan = measure_planner(handles, cfg.target, cfg.drafters) if planner else None
    # -- end planner --
    return Engine.configured(handles, load_tokenizer(cfg), cfg.target, cfg.engine, planner=plan)


def measure_planner(handles: dict[str, ModelHandle], target: str, drafters: list[str], *,
                    rows=(1, 2, 4, 8, 16, 32), new_tokens=(1, 2, 3, 5, 9), context: int = 64,
                    iters: int = 3) -> Planner:
    """A :class:`Planner` over forward costs measured now with :func:`forward_cost_grid`: the target over
    ``rows`` x ``new_tokens``, each neural drafter over ``rows`` x one token (the planner prices k drafter
    forwards of one token).  Deterministic drafters (the Max-Gram drafter) get no table: drafting is free."""
    costs = {}
    for name in dict.fromkeys([target, *drafters]):
        handle = handles[name]
        if getattr(handle, "deterministic", False) or not hasattr(handle, "score_batch"):
            continue
        grid = forward_cost_grid(handle, rows=rows, new_tokens=new_tokens if name == target else (1,),
                                 context=min(context, handle.max_length - max(new_tokens)), iters=iters)
        costs[name] = ForwardCost(grid).monotone()          # timing noise: never cheaper when larger
    return Planner(costs, target)
