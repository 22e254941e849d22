"""The model interface the algorithm core talks to (one instance per hosted model).

These are the protocols of the algorithm core: the model handle and the tokenizer.  A handle keeps per-request state keyed by a request id: the token sequence it has seen and a KV
cache covering all but (at least) the last of those tokens -- the *pending* tokens are fed with the
next forward pass.  The same interface is served in-process (:mod:`cluster.models`) and by Ray
actors (:mod:`actors`, through :mod:`cluster.serving.remote`), so every strategy runs unchanged on both.

Shapes: ``propose`` returns ``(tokens [k], logits [k, V])``; ``score`` returns ``logits [L+1, V]``.
Logits are raw (unscaled); the core applies :func:`cluster.core.sampling.logits_to_probs` with the same
parameters the handle used to sample, so proposal distributions are reproduced exactly.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from cluster.core.sampling import SamplingParams


@runtime_checkable
class ModelHandle(Protocol):
    name: str
    vocab_size: int
    max_length: int      # positions the model supports (prompt + generated + draft)
    num_params: int      # cost proxy for the standardized walltime improvement
    # Declared capability: a deterministic drafter (the Max-Gram drafter) proposes each token with
    # probability 1, so its proposal logits are one-hot (0 at the token, -inf elsewhere) and a forward
    # pass costs nothing worth counting per token.  Neural models sample and set it False.
    deterministic: bool

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


class TextStream(Protocol):
    """Incremental detokenisation of one sequence: each token is decoded once, and text comes out only
    once it can no longer change (never half a character)."""

    def step(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is still incomplete)."""

    def flush(self) -> str:
        """The text still held back at the end (an incomplete character decodes as U+FFFD, as ``decode`` does)."""


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer (:mod:`cluster.models.tokenizer` has the backends)."""

    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def stream(self) -> TextStream:
        """A fresh :class:`TextStream`: its ``step`` texts for ``ids``, then ``flush``, concatenate to
        ``decode(ids)``."""
