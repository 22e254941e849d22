"""Constrained decoding under speculation: the pure part (torch only; the grammar engine lives behind
:class:`Constraint`, see :mod:`cluster.models.grammar`).

A request with a grammar (``response_format`` JSON schema, a forced tool call) samples from the
*constrained target law*: at every position the target's logits with the tokens the grammar forbids set
to -inf, then temperature / top-k / top-p as usual (:func:`cluster.core.sampling.logits_to_probs`).  This
is the law of constrained autoregressive decoding (the logits processor of vLLM's and SGLang's structured
output), and every lossless strategy samples it exactly because both sides of verification are masked:

* the target's rows ``p_i`` (position i of a block: after committed + draft[:i]) are masked by
  :func:`constrain_rows` before verification;
* every drafter samples from its own masked logits and hands those on (:func:`mask_logits` in the worker,
  the Max-Gram drafts cut at their first forbidden token by :func:`valid_prefix`), so ``q_i`` is the
  masked, renormalised law each draft token was drawn from.

Speculative sampling (Leviathan et al. 2023, *Fast Inference from Transformers via Speculative Decoding*,
Alg. 1; Chen et al. 2023, Alg. 2) and block verification (Sun et al. 2024, *Block Verification Accelerates
Speculative Decoding*, Alg. 2) emit exactly ``p`` for ANY pair (q, p) of distributions whose q the draft was
drawn from, so with the masked pair they emit exactly the masked ``p``; the same holds level by level in a
CS Drafting cascade (Chen et al. 2024).  Masking q is what keeps drafts useful (an unmasked draft token the
grammar forbids has p = 0 and is always rejected).  Cutting a Max-Gram draft is exact because its draft is
a deterministic function of the prefix (any prefix-determined draft length is).  ``tests/core/
test_constraint_exact.py`` proves all of this by exact enumeration.

A :class:`Constraint` keeps one request's grammar state; it is asked about whole token sequences
(``allowed(tokens)``: prompt + generated + draft) and moves its state there itself: advance over new
tokens, roll back over rejected ones, so every model of a request (target, drafters, the draft side) can
ask about its own working sequence.
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class Constraint(Protocol):
    """One request's grammar state (a decoding constraint over the tokens after its prompt)."""

    def allowed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Bool ``[V]``: the tokens the grammar allows after ``tokens`` (the prompt and what follows it).
        After a sequence the grammar forbids, or once it is complete, only the end-of-text token."""


@runtime_checkable
class Grammar(Protocol):
    """A compiled grammar (one per schema, shared by requests): ``start`` gives a request its state."""

    field: str          # the request parameter it came from (``response_format``, ``tool_choice``): errors name it

    def start(self, prompt_length: int) -> Constraint:
        """The state of a request whose prompt is ``prompt_length`` tokens long (generation starts there)."""


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits [..., V]`` with every token outside ``allowed [..., V']`` (one mask, or one per row) set to
    -inf (a mask shorter than the logits forbids the rest: padding rows of a model's vocabulary are never
    allowed).  A row that gives no allowed token a finite logit (a model with exact zeros, e.g. a tabular test
    drafter) becomes uniform over the allowed tokens, so the masked law is always defined."""
    V = logits.shape[-1]
    keep = allowed[..., :V] if allowed.shape[-1] >= V else torch.cat(
        [allowed, allowed.new_zeros(*allowed.shape[:-1], V - allowed.shape[-1])], -1)
    out = logits.masked_fill(~keep, float("-inf"))
    dead = ~torch.isfinite(out).any(-1, keepdim=True)                       # [..., 1]
    return torch.where(dead & keep, torch.zeros_like(out), out)


def constrain_rows(constraint: Constraint | None, prefix: Sequence[int], draft: Sequence[int],
                   logits: torch.Tensor) -> torch.Tensor:
    """Rows ``[L+1, V]`` of a forward over ``draft`` after ``prefix``, row i masked by the grammar after
    ``prefix + draft[:i]``.  Rows after a draft token the grammar forbids are masked as that position's
    successors (only end of text): verification never reaches them (that token has p = 0)."""
    if constraint is None:
        return logits
    return mask_logits(logits, row_masks(constraint, prefix, draft).to(logits.device))


def row_masks(constraint: Constraint, prefix: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
    """Bool ``[L+1, V']``: row i the tokens the grammar allows after ``prefix + draft[:i]``."""
    seq = list(prefix)
    rows = []
    for i in range(len(draft) + 1):
        rows.append(constraint.allowed(seq))
        if i < len(draft):
            seq.append(draft[i])
    return torch.stack(rows)


def valid_prefix(constraint: Constraint | None, prefix: Sequence[int], draft: Sequence[int]) -> int:
    """How many leading tokens of ``draft`` the grammar allows after ``prefix`` (all without a constraint)."""
    if constraint is None:
        return len(draft)
    seq = list(prefix)
    for i, tok in enumerate(draft):
        allowed = constraint.allowed(seq)
        if not (0 <= tok < allowed.shape[-1] and bool(allowed[tok])):
            return i
        seq.append(tok)
    return len(draft)
