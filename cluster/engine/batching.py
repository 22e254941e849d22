"""Running one round of many requests' model calls: grouped per model and kind, one batched call each.

A handle that implements the batched forms (``prefill_batch``, ``propose_batch``, ``score_batch``,
``propose_adaptive_batch``; :class:`cluster.models.batched.BatchedHFWorker`, remote handles) gets one call
per group; any other handle (test doubles, simple drafters) gets the per-request calls in order.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from cluster.core.interfaces import ModelHandle
from cluster.core.sampling import SamplingParams
from cluster.strategies import ModelCall, Propose, ProposeAdaptive, Score

_BATCHED = {Propose: "propose_batch", Score: "score_batch", ProposeAdaptive: "propose_adaptive_batch"}


def _args(call: ModelCall) -> tuple:
    if isinstance(call, Propose):
        return (call.k,)
    if isinstance(call, Score):
        return (list(call.draft),)
    return (call.k_max, call.head, call.threshold, call.eos)


def run_group(handle: ModelHandle, kind: type, items: list[tuple[str, ModelCall]]) -> list[Any]:
    """Results of ``items`` = [(request id, call)], all of ``kind`` on ``handle``, in order."""
    batched = getattr(handle, _BATCHED[kind], None)
    if batched is not None:
        return batched([(rid, *_args(call)) for rid, call in items])
    single = getattr(handle, _BATCHED[kind].removesuffix("_batch"))
    return [single(rid, *_args(call)) for rid, call in items]


def group_calls(pending: dict[Any, ModelCall], target: str) -> dict[tuple[str, type], list[Any]]:
    """The calls to run this round, keyed by (model, kind): every drafter call first; the target's calls
    only once no request waits on a drafter, so all of a step's verifications share one target pass."""
    drafting = [key for key, call in pending.items() if call.model != target]
    groups: dict[tuple[str, type], list[Any]] = defaultdict(list)
    for key in drafting or list(pending):
        call = pending[key]
        groups[(call.model, type(call))].append(key)
    return groups


def prefill(handle: ModelHandle, items: list[tuple[str, list[int], SamplingParams, int]]) -> None:
    batched = getattr(handle, "prefill_batch", None)
    if batched is not None:
        batched(items)
    else:
        for item in items:
            handle.prefill(*item)
