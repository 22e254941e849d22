"""One engine step's strategy generators advanced together: their model calls grouped per (model, kind) into
one batched call per round (:func:`cluster.core.calls.group_calls`), until every generator has returned.

A drafter that went away mid-step (:class:`ModelUnavailableError` from a model other than the target) costs
its requests only the step's speculation: each such request's target cache is rolled back to its committed
tokens and the step is redone by ``step_of`` (the engine's target-only fallback while that model is down).
Any other failure fails only the requests of the group it came from.
"""
from __future__ import annotations

from typing import Any, Callable

from cluster.core.calls import advance, group_calls, run_group
from cluster.engine.sequence import FINISHED, Sequence
from cluster.errors import ModelUnavailableError


def run_rounds(running: list[Sequence], models: dict, target: str, step_of: Callable[[Sequence], Any],
               model_down: Callable[[str, BaseException], None]) -> dict[Sequence, Any]:
    """-> each request's step result (its emitted tokens) or the exception that failed it."""
    gens, pending, out = {}, {}, {}
    for seq in running:
        if seq.status == FINISHED:
            continue
        gens[seq] = step_of(seq)
        advance(seq, gens[seq], None, pending, out)
    while pending:
        for (model, kind), seqs in group_calls(pending, target).items():
            try:
                results = run_group(models[model], kind, [(s.rid, pending[s]) for s in seqs])
            except ModelUnavailableError as e:
                model_down(model, e)                 # once for the group; the target's requests fail below
                results = [e] * len(seqs)
            except Exception as e:                   # noqa: BLE001 - fails this group's requests only
                results = [e] * len(seqs)
            for seq, result in zip(seqs, results):
                del pending[seq]
                if isinstance(result, ModelUnavailableError) and model != target:
                    gens[seq].close()                # a drafter went away: redo this step on the target
                    models[target].rollback(seq.rid, len(seq.ctx.tokens))
                    gens[seq] = step_of(seq)
                    advance(seq, gens[seq], None, pending, out)
                elif isinstance(result, BaseException):
                    gens[seq].close()
                    out[seq] = result
                else:
                    advance(seq, gens[seq], result, pending, out)
    return out
