"""The engine's default KV budget: how many KV positions its running requests may reserve when the config
sets no ``engine.kv_budget_tokens``.

Every hosted model reports its KV bytes per cached token, its weight bytes and its device's memory with the
domain that memory belongs to (:mod:`cluster.models.memory`; remote handles forward the actor's report).  A
reserved position is cached by the target and by every drafter, so in each domain

    budget = (kv_memory_fraction x memory - weights of the models there) / (KV bytes per token of those models)

and the engine's budget is the smallest over the domains (the first to run out bounds everyone), as vLLM sizes
its KV cache from ``gpu_memory_utilization`` after the weights are loaded.  ``device_memory_gib`` replaces every
domain's detected memory (a device shared with other work, or a test).  Handles without a report (the Max-Gram
drafter, the draft side, test fakes) hold no KV and are skipped; with no report at all there is no budget.
"""
from __future__ import annotations

import logging

from cluster.errors import ConfigError

log = logging.getLogger("specserve.engine")
GIB = 1 << 30


def derive_kv_budget(models: dict, *, fraction: float = 0.9, memory_gib: float | None = None) -> int | None:
    """The KV budget in positions (see the module docstring), or None when no model reports its memory."""
    domains: dict[str, dict] = {}
    for name, handle in models.items():
        rep = handle.memory
        if not isinstance(rep, dict):
            continue
        d = domains.setdefault(rep["domain"], {"memory": rep["memory_bytes"], "weights": 0, "kv": 0, "names": []})
        d["weights"] += int(rep["weight_bytes"])
        d["kv"] += int(rep["kv_bytes_per_token"])
        d["names"].append(name)
    if not domains:
        return None
    budgets = {}
    for domain, d in domains.items():
        memory = memory_gib * GIB if memory_gib is not None else d["memory"]
        free = fraction * memory - d["weights"]
        if free < d["kv"]:
            raise ConfigError(f"engine.kv_memory_fraction x memory ({fraction:g} x {memory / GIB:.2f} GiB on "
                              f"{domain}) leaves no room for KV after the weights of {', '.join(d['names'])} "
                              f"({d['weights'] / GIB:.2f} GiB): raise it, set engine.device_memory_gib, or set "
                              f"engine.kv_budget_tokens")
        budgets[domain] = int(free // d["kv"]) if d["kv"] else None
    budget = min(b for b in budgets.values() if b is not None) if any(b is not None for b in budgets.values()) \
        else None
    log.info("KV budget derived from device memory: %s positions (per domain: %s)", budget, budgets)
    return budget
