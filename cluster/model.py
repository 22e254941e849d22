"""The model interface the algorithm core talks to (one instance per hosted model).

A handle keeps per-request state keyed by a request id: the token sequence it has seen and a KV
cache covering all but (at least) the last of those tokens -- the *pending* tokens are fed with the
next forward pass.  The same interface is served in-process (:mod:`cluster.worker`) and by Ray
actors (:mod:`actors`), so every strategy runs unchanged on both.

Shapes: ``propose`` returns ``(tokens [k], logits [k, V])``; ``score`` returns ``logits [L+1, V]``.
Logits are raw (unscaled); the core applies :func:`cluster.sampling.logits_to_probs` with the same
parameters the handle used to sample, so proposal distributions are reproduced exactly.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .sampling import SamplingParams


@runtime_checkable
class ModelHandle(Protocol):
    name: str
    vocab_size: int
    max_length: int      # positions the model supports (prompt + generated + draft)
    num_params: int      # cost proxy for the standardized walltime improvement

    def prefill(self, rid: str, ids: list[int], sampling: SamplingParams, seed: int) -> None:
        """Start request ``rid`` with context ``ids``; caches all but the last token."""

    def propose(self, rid: str, k: int) -> tuple[list[int], torch.Tensor]:
        """Sample k tokens autoregressively (k forward passes); append them; return tokens and logits."""

    def score(self, rid: str, draft: list[int]) -> torch.Tensor:
        """Append ``draft`` and run one forward pass; logits ``[L+1, V]`` at the last L+1 positions."""

    def rollback(self, rid: str, length: int) -> None:
        """Truncate the request's sequence to ``length`` tokens (crops the KV cache)."""

    def extend(self, rid: str, ids: list[int]) -> None:
        """Append tokens without a forward pass (they become pending)."""

    def release(self, rid: str) -> None:
        """Forget request ``rid`` (idempotent)."""
