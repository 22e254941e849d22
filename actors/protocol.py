"""The per-step wire contract between a serving unit and its model actors (both ends import it).

One engine step costs one round trip per model: :class:`StepCall` carries the bookkeeping calls that
return nothing (:data:`OPS`: rollback / extend / release, queued by the caller since the last call, in
order) and then at most one batched method (:data:`METHODS`) over all of the step's requests for that
model.  The actor answers ``(result, StepTime)``: its compute seconds and where the call was on the host's
clock (:class:`StepTime`).  Tensors travel as numpy arrays
(:func:`pack` / :func:`unpack`): Ray serialises those out of band.

A call is addressed to the actor's hosted handle, or (``member``) to one drafter hosted beside it: the
draft-group actor (:mod:`actors.draft_actor`) hosts the draft side and every drafter of a unit.

Bytes per step and request (embedded family, V = 4096): a ``draft_batch`` answer is a
:class:`cluster.core.draft.programs.DraftBlock` -- 8 B per token when greedy or deterministic, the truncated
support (16 B per kept token: id + float64 probability) under top-k / top-p, L x V x 4 B of logits only for untruncated sampling;
a per-drafter ``propose`` of k tokens returns k x V x 4 B (16 KiB per token; 512 KiB for a 128k vocabulary),
which is why verification runs where the target's logits are (docs/operator-guide.md, "Topologies").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import time
from typing import Any, NamedTuple

import numpy as np
import torch

from cluster.core.interfaces import UnknownRequestError, rows_asked
from cluster.core.sampling import onehot_logits

OPS = ("rollback", "extend", "release")
METHODS = ("prefill_batch", "propose_batch", "score_batch", "propose_adaptive_batch", "draft_batch", "verify_batch")


@dataclass
class StepCall:
    ops: list[tuple[str, str, tuple]] = field(default_factory=list)   # (op, request id, args), in order
    method: str | None = None                                          # one of METHODS, or None (ops only)
    items: list = field(default_factory=list)                          # the method's per-request items
    member: str | None = None                                          # a drafter beside the hosted handle


def stamp() -> float:
    """The clock every per-hop stamp is read from: ``time.monotonic``, ``CLOCK_MONOTONIC`` on Linux -- one clock for
    every process of a host (not per process), so a caller subtracts an actor's stamps from its own.  Stamps of
    processes on different hosts are not comparable (the benchmarks run on one)."""
    return time.monotonic()


class StepTime(NamedTuple):
    """Where one call went on the model's side.  ``entry`` / ``exit``: :func:`stamp` when the host began and ended
    the call (its reply not yet serialised); ``wait_s``: of that, waiting for the host's own background work
    (the draft host's pre-draft) before computing; ``compute_s``: running the call; ``hits`` / ``misses``:
    pre-drafted blocks this call used / dropped (the draft host)."""

    compute_s: float
    entry: float = 0.0
    exit: float = 0.0
    wait_s: float = 0.0
    hits: int = 0
    misses: int = 0


class StateLostError(RuntimeError):
    """The actor does not know a request it is asked about: it was restarted and its state is gone."""


def apply(handle, call: StepCall) -> Any:
    """Run ``call`` on the hosted model handle (the actor side; ``call.member`` already resolved by the
    host); returns the method's packed result."""
    try:
        for op, rid, args in call.ops:
            if op not in OPS:
                raise ValueError(f"unknown op {op!r}")
            getattr(handle, op)(rid, *args)
        if call.method is None:
            return None
        if call.method not in METHODS:
            raise ValueError(f"unknown method {call.method!r}")
        out = getattr(handle, call.method)(call.items)
        return pack(tokens_only(call.method, out) if handle.deterministic else out)
    except UnknownRequestError as e:      # a request the handle does not hold: the actor restarted
        raise StateLostError(str(e)) from None


def tokens_only(method: str, out):
    """A deterministic drafter's one-hot logits travel as the tokens they mark (``k`` ints instead of
    ``k x V`` floats); :func:`expand_onehot` rebuilds them on the caller's side."""
    if method in ("propose_batch", "propose_adaptive_batch"):
        return [(list(toks), None) for toks, _ in out]
    if method == "score_batch":
        return [logits.argmax(-1).tolist() for logits in out]
    return out


def expand_onehot(method: str, out, vocab_size: int, items: list | None = None):
    """The one-hot rows back, for the items that asked for rows (a propose item's ``rows``; default: all)."""
    if method in ("propose_batch", "propose_adaptive_batch"):
        asked = [method == "propose_adaptive_batch" or rows_asked(it) for it in items or [()] * len(out)]
        return [(toks, onehot_logits(toks, vocab_size) if want else None) for (toks, _), want in zip(out, asked)]
    if method == "score_batch":
        return [onehot_logits(preds, vocab_size) for preds in out]
    return out


def pack(out):
    """Tensors as numpy arrays, recursively through lists, tuples and dataclasses (draft blocks)."""
    if isinstance(out, torch.Tensor):
        return out.detach().cpu().numpy()                # a device tensor crosses here, and only here
    if isinstance(out, tuple) and hasattr(out, "_fields"):          # a NamedTuple (a verdict)
        return type(out)(*(pack(x) for x in out))
    if isinstance(out, (list, tuple)):
        return type(out)(pack(x) for x in out)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return dataclasses.replace(out, **{f.name: pack(getattr(out, f.name)) for f in dataclasses.fields(out)})
    return out


def unpack(out):
    """numpy arrays back to tensors (copied: Ray hands out read-only buffers)."""
    if isinstance(out, np.ndarray):
        return torch.from_numpy(out.copy())
    if isinstance(out, tuple) and hasattr(out, "_fields"):          # a NamedTuple (a verdict)
        return type(out)(*(unpack(x) for x in out))
    if isinstance(out, (list, tuple)):
        return type(out)(unpack(x) for x in out)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return dataclasses.replace(out, **{f.name: unpack(getattr(out, f.name)) for f in dataclasses.fields(out)})
    return out


def nbytes(out) -> int:
    """Payload bytes of a packed result (arrays, and 8 per token id): what a step moves back per model."""
    if isinstance(out, np.ndarray):
        return out.nbytes
    if isinstance(out, int):
        return 8
    if isinstance(out, (list, tuple)):
        return sum(nbytes(x) for x in out)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return sum(nbytes(getattr(out, f.name)) for f in dataclasses.fields(out))
    return 0
