"""Running one round of many requests' model calls: grouped per model and kind, one batched call each.

A handle that implements the batched forms (``prefill_batch``, ``propose_batch``, ``score_batch``,
``propose_adaptive_batch``, ``draft_batch``; :class:`cluster.models.batched.BatchedHFWorker`, remote
handles, the draft side) gets one call per group (:func:`cluster.core.calls.run_group`); any other handle
(test doubles, simple drafters) gets the per-request calls in order.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from cluster.core.calls import ModelCall, prefill, run_group  # noqa: F401 (re-exported for the engine)


def group_calls(pending: dict[Any, ModelCall], target: str) -> dict[tuple[str, type], list[Any]]:
    """The calls to run this round, keyed by (model, kind): every drafter call first; the target's calls
    only once no request waits on a drafter, so all of a step's verifications share one target pass."""
    drafting = [key for key, call in pending.items() if call.model != target]
    groups: dict[tuple[str, type], list[Any]] = defaultdict(list)
    for key in drafting or list(pending):
        call = pending[key]
        groups[(call.model, type(call))].append(key)
    return groups
