"""The model calls a step yields, and running a group of them as one batched call on a handle.

A strategy's step (and a draft program, :mod:`cluster.core.drafting`) is a generator that yields these
calls and receives their results; whoever drives it (the engine, or the draft side for many requests)
groups the calls of many requests per (model, kind) (:func:`group_calls`), runs each group as ONE batched
call (:func:`run_group`) and sends each result back into its generator (:func:`advance`).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Propose:
    """Draft ``k`` tokens autoregressively with ``model`` -> ``(tokens [k], raw logits [k, V])``."""

    model: str
    k: int


@dataclass(frozen=True)
class ProposeAdaptive:
    """SpecDec++ drafting with ``model``: at most ``k_max`` tokens, stopping by the acceptance ``head``'s
    rule at ``threshold`` or right after an ``eos`` candidate (:class:`cluster.core.draft_stop.DraftStop`)
    -> ``(tokens [K], raw logits [K, V])``."""

    model: str
    k_max: int
    head: Any
    threshold: float
    eos: int | None = None


@dataclass(frozen=True)
class Score:
    """Append ``draft`` and run one forward pass of ``model`` -> raw logits ``[L+1, V]``."""

    model: str
    draft: tuple[int, ...]


@dataclass(frozen=True)
class Draft:
    """Ask the draft side ``model`` for one block of drafts -> :class:`cluster.core.drafting.DraftBlock`.

    ``spec`` (:class:`cluster.core.drafting.DraftSpec`) says how (one drafter, SpecDec++, or a CS Drafting
    cascade), ``limit`` how many tokens at most, ``budget`` how many the request may still emit this step
    (what the draft side may draft ahead for the next step).  However deep the drafting, it is one call (one
    round trip when the draft side is an actor)."""

    model: str
    spec: Any
    limit: int
    budget: int


ModelCall = Propose | ProposeAdaptive | Score | Draft

# call kind -> (the batched method of BatchedHandle, the per-request item's fields after the request id)
BATCHED = {Propose: "propose_batch", Score: "score_batch", ProposeAdaptive: "propose_adaptive_batch",
           Draft: "draft_batch"}


def call_args(call: ModelCall) -> tuple:
    """The fields of one request's item in the batched call (after its request id)."""
    if isinstance(call, Propose):
        return (call.k,)
    if isinstance(call, Score):
        return (list(call.draft),)
    if isinstance(call, Draft):
        return (call.spec, call.limit, call.budget)
    return (call.k_max, call.head, call.threshold, call.eos)


def run_group(handle, kind: type, items: list[tuple[str, ModelCall]]) -> list[Any]:
    """Results of ``items`` = [(request id, call)], all of ``kind`` on ``handle``, in order: one batched call
    on a handle with the batched form (workers, remote handles, the draft side); a simple handle (test
    doubles) gets the per-request calls in order."""
    method = BATCHED[kind]
    batched = getattr(handle, method, None)
    if batched is not None:
        return batched([(rid, *call_args(call)) for rid, call in items])
    single = getattr(handle, method.removesuffix("_batch"))
    return [single(rid, *call_args(call)) for rid, call in items]


def prefill(handle, items: list[tuple]) -> None:
    """Start ``items`` = [(request id, token ids, sampling, seed)] on ``handle``: one batched call where it has one."""
    batched = getattr(handle, "prefill_batch", None)
    if batched is not None:
        batched(items)
    else:
        for item in items:
            handle.prefill(*item)


def prefill_scored(handle, items: list[tuple]) -> list[Any]:
    """Start ``items`` = [(request id, token ids [P >= 2], sampling, seed)] on ``handle`` as :func:`prefill`
    does, and return each prompt's raw logits ``[P-1, V]`` (row i: the distribution of ``ids[i+1]``) from the
    same forward that fills the cache: the first token is prefilled alone, the rest but the last scored as a
    draft (one batched forward for all items), and the last token appended as prefill leaves it, pending."""
    prefill(handle, [(rid, ids[:1], sampling, seed) for rid, ids, sampling, seed in items])
    name = getattr(handle, "name", "")
    logits = run_group(handle, Score, [(rid, Score(name, tuple(ids[1:-1]))) for rid, ids, _, _ in items])
    for rid, ids, _, _ in items:
        handle.extend(rid, [ids[-1]])
    return logits


def group_calls(pending: dict[Any, ModelCall], target: str | None = None) -> dict[tuple[str, type], list[Any]]:
    """The calls to run this round, keyed by (model, kind).  With a ``target``: every other model's calls
    first, the target's only once no request waits on a drafter, so all of a step's verifications share one
    target pass (the engine); without one, every pending call (the draft side)."""
    drafting = [key for key, call in pending.items() if call.model != target]
    groups: dict[tuple[str, type], list[Any]] = defaultdict(list)
    for key in drafting or list(pending):
        call = pending[key]
        groups[(call.model, type(call))].append(key)
    return groups


def advance(key, gen, value, pending: dict, done: dict) -> None:
    """Send ``value`` into generator ``gen``: its next call goes to ``pending[key]``, its return value (or the
    exception it raised: it fails that request only) to ``done[key]``."""
    try:
        pending[key] = gen.send(value)
    except StopIteration as stop:
        done[key] = stop.value
    except Exception as e:                               # noqa: BLE001 - an error fails its own request
        done[key] = e
