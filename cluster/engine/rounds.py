"""One engine step's strategy generators advanced together (:func:`cluster.core.calls.drive`): their model
calls grouped per (model, kind) into one batched call per round, drafters first, until every generator has
returned.

A drafter that went away mid-step (:class:`ModelUnavailableError` from a model other than the target) costs
its requests only the step's speculation: each such request's target cache is rolled back to its committed
tokens and the step is redone by ``step_of`` (the engine's target-only fallback while that model is down).
Any other failure fails only the requests of the group it came from.
"""
from __future__ import annotations

from typing import Any, Callable

from cluster.core.calls import drive
from cluster.engine.sequence import FINISHED, Sequence
from cluster.errors import ModelUnavailableError


def run_rounds(running: list[Sequence], models: dict, target: str, step_of: Callable[[Sequence], Any],
               model_down: Callable[[str, BaseException], None]) -> dict[Sequence, Any]:
    """-> each request's step result (its emitted tokens) or the exception that failed it."""

    def group_failed(model: str, error: Exception) -> None:
        if isinstance(error, ModelUnavailableError):
            model_down(model, error)             # once for the group; the target's requests fail

    def redo(seq: Sequence, model: str, error: BaseException):
        if isinstance(error, ModelUnavailableError) and model != target:
            models[target].rollback(seq.rid, len(seq.ctx.tokens))    # a drafter went away: redo on the target
            return step_of(seq)
        return None

    gens = {seq: step_of(seq) for seq in running if seq.status != FINISHED}
    return drive(gens, models, lambda seq: seq.rid, target=target, group_failed=group_failed, redo=redo)
