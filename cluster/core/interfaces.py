"""The model interface the engine calls (one instance per hosted model), and the tokenizer protocol.

:class:`BatchedHandle` is what the engine, the draft side and the actors drive: an abstract core, optional
methods with defaults, and declared capabilities (the shape of Ray Serve LLM's ``LLMEngine`` protocol).  A
handle keeps per-request state keyed by a request id: the token sequence it has seen and a KV cache covering
all but (at least) the last of those tokens -- the *pending* tokens are fed with the next forward pass.  Every
method that does work takes one item per request, so one call advances many requests (continuous batching).
The same interface is served in-process (:mod:`cluster.models`, :mod:`cluster.core.draft.side`) and over Ray
actors (:mod:`cluster.serving.control.remote`), so every strategy runs unchanged on both.

Item and result shapes (V: vocabulary; every logits tensor is raw, unscaled -- the core applies
:func:`cluster.core.sampling.logits_to_probs` with the parameters the handle sampled with, so proposal
distributions are reproduced exactly):

  prefill_batch           (rid, ids [P >= 1], SamplingParams, seed[, salt]) -> None, or the prompt tokens each
                                                                              found in a prefix cache (all but
                                                                              ids[-1] end up cached)
  score_batch             (rid, draft [L])                                 -> logits [L+1, V]
  propose_batch           (rid, k)                                         -> (tokens [k], logits [k, V])
  propose_adaptive_batch  (rid, k_max, head, threshold, eos)               -> (tokens [K <= k_max], logits [K, V])
  draft_batch             (rid, DraftSpec, limit, budget)                  -> DraftBlock (or the exception)
  verify_batch            VerifyItem (rid, draft [L], q block, sampling, ...) -> Verified (accepted, token)

A call about a request the handle does not hold raises :class:`UnknownRequestError` (the actors read it as
"restarted, state lost"); ``release`` of an unknown request is a no-op.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch

from cluster.core.sampling import SamplingParams, onehot_logits
from cluster.core.verify_round import review_round, stack_rows, verify_round


class UnknownRequestError(KeyError):
    """A handle was asked about a request id it does not hold (never prefilled, released, or lost in a restart)."""

    def __init__(self, model: str, rid: str):
        super().__init__(f"{model}: unknown request {rid!r}")
        self.model, self.rid = model, rid

    def __str__(self) -> str:
        return self.args[0]


class UnsupportedCallError(NotImplementedError):
    """An optional method the handle does not implement (its capabilities say so: ask them first)."""

    def __init__(self, model: str, method: str):
        super().__init__(f"{model}: no {method} (see its declared capabilities)")


class BatchedHandle(ABC):
    """One hosted model (or the draft side) as the engine drives it; see the module docstring."""

    name: str
    vocab_size: int
    max_length: int                  # positions the model supports (prompt + generated + draft)
    num_params: int = 0              # cost proxy for the standardized walltime improvement
    # -- declared capabilities (defaults: a neural model that only scores) ----------------------
    # a deterministic drafter (the Max-Gram drafter) proposes each token with probability 1: its proposal
    # logits are one-hot (0 at the token, -inf elsewhere) and a forward costs nothing worth counting per token
    deterministic: bool = False
    statistical: str | None = None   # which deterministic drafter: "maxgram" or "suffix" (strategies find theirs by it)
    proposes: bool = False           # implements propose_batch (a drafter)
    adaptive: bool = False           # implements propose_adaptive_batch (SpecDec++ drafting)
    laws: bool = False               # propose_batch's ``law`` items answered with the laws the tokens were drawn from
    specdec_head: str | None = None  # the path of the SpecDec++ acceptance head it drafts with, if built
    memory: dict | None = None       # KV bytes per token, weights, device memory (the engine's KV budget)

    # -- required ---------------------------------------------------------------------------------
    @abstractmethod
    def prefill_batch(self, items: list[tuple[str, list[int], SamplingParams, int]]) -> list[int] | None:
        """Start each request with its context; caches all but the last token (restarting a known id) -> the
        tokens of each found in a prefix cache, or None (a handle without one)."""

    @abstractmethod
    def score_batch(self, items: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Append each draft and run one forward pass: logits ``[L+1, V]`` at the last L+1 positions."""

    @abstractmethod
    def rollback(self, rid: str, length: int) -> None:
        """Truncate the request's sequence to ``length`` tokens (crops the KV cache)."""

    @abstractmethod
    def extend(self, rid: str, ids: list[int]) -> None:
        """Append tokens without a forward pass (they become pending)."""

    @abstractmethod
    def release(self, rid: str) -> None:
        """Forget request ``rid`` (idempotent: an unknown id is a no-op)."""

    # -- optional (declared by ``proposes`` / ``adaptive``; the draft side's own call) ------------------
    def propose_batch(self, items: list[tuple]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Sample k tokens autoregressively per item ``(rid, k[, rows[, law]])``; append them; tokens ``[k]``,
        logits ``[k, V]`` (a handle may answer None where ``rows`` is False: the caller reads the tokens only; one
        that declares ``laws`` answers ``law`` items with the probabilities the tokens were drawn from)."""
        raise UnsupportedCallError(self.name, "propose_batch")

    def propose_adaptive_batch(self, items: list[tuple]) -> list[tuple[list[int], torch.Tensor]]:
        """SpecDec++ drafting per item ``(rid, k_max, head, threshold, eos)``."""
        raise UnsupportedCallError(self.name, "propose_adaptive_batch")

    def draft_batch(self, items: list[tuple]) -> list[Any]:
        """The draft side's blocks, one per item ``(rid, DraftSpec, limit, budget)``."""
        raise UnsupportedCallError(self.name, "draft_batch")

    def verify_batch(self, items: list) -> list:
        """Score each item's draft and verify it (:class:`cluster.core.verify_round.VerifyItem` ->
        ``Verified``): by default ``score_batch``'s rows, verified in one batched call where they land; a
        handle that owns a device (:class:`cluster.models.batched.BatchedHFWorker`) keeps the logits there."""
        rows = self.score_batch([(it.rid, it.draft) for it in items])
        return verify_round(stack_rows(rows), items)

    def review_batch(self, items: list) -> list:
        """CS Drafting's reviews (:class:`cluster.core.verify_round.ReviewItem` -> ``Reviewed``): by default
        ``score_batch``'s rows, reviewed in one batched call where they land."""
        rows = self.score_batch([(it.rid, it.draft) for it in items])
        return review_round(stack_rows(rows), items)

    # -- defaulted --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Send bookkeeping a handle queues (a remote one) now; in-process handles queue nothing."""

    def probe(self) -> bool:
        """After the handle failed with ModelUnavailableError: True once it answers again."""
        return True

    def active_requests(self) -> list[str]:
        """The request ids it holds state for (operators' view; empty where it does not track them)."""
        return []

    def cache_info(self) -> dict:
        """Its prefix cache's size now (operators' view): ``tokens`` it can serve, ``slots`` it keeps; a draft
        side's as ``members``: name -> theirs; empty without a cache."""
        return {}

    def capabilities(self) -> dict:
        """What the handle declares, as plain values (an actor sends it to the remote handle over it)."""
        return dict(name=self.name, vocab_size=self.vocab_size, max_length=self.max_length,
                    num_params=int(self.num_params), deterministic=bool(self.deterministic),
                    statistical=self.statistical,
                    proposes=bool(self.proposes), adaptive=bool(self.adaptive), specdec_head=self.specdec_head,
                    memory=self.memory)


class PerRequestHandle(BatchedHandle):
    """The one adapter for handles whose work is per request anyway (the Max-Gram drafter, the tests' tabular
    models): they write ``prefill`` / ``score`` (and ``propose`` / ``propose_adaptive`` where they declare
    them), and the batched forms run them item by item, in order."""

    @abstractmethod
    def prefill(self, rid: str, ids: list[int], sampling: SamplingParams, seed: int) -> None: ...

    @abstractmethod
    def score(self, rid: str, draft: list[int]) -> torch.Tensor: ...

    def propose(self, rid: str, k: int) -> tuple[list[int], torch.Tensor]:
        raise UnsupportedCallError(self.name, "propose")

    def propose_adaptive(self, rid: str, k_max: int, head, threshold: float, eos: int | None = None):
        raise UnsupportedCallError(self.name, "propose_adaptive")

    def prefill_batch(self, items) -> None:
        """Each item's ``prefill`` (a salt, the fifth field, is for handles that keep state across requests:
        they override this)."""
        for rid, ids, sampling, seed, *_ in items:
            self.prefill(rid, ids, sampling, seed)

    def score_batch(self, items) -> list[torch.Tensor]:
        return [self.score(rid, list(draft)) for rid, draft in items]

    def propose_batch(self, items) -> list[tuple[list[int], torch.Tensor]]:
        return [self.propose(rid, k) for rid, k, *_ in items]

    def propose_adaptive_batch(self, items) -> list[tuple[list[int], torch.Tensor]]:
        return [self.propose_adaptive(rid, *rest) for rid, *rest in items]


def rows_asked(item: tuple) -> bool:
    """Whether a propose item ``(rid, k[, rows[, law]])`` asks for its rows (default: yes)."""
    return len(item) < 3 or bool(item[2])


class DeterministicDrafter(PerRequestHandle):
    """A drafter that proposes each token with probability 1 (the Max-Gram and suffix drafters): it writes
    :meth:`draft_tokens`, and its one-hot rows (q, 0 at the token and -inf elsewhere) are built only for a
    caller that asks for rows (CS Drafting's reviews read them); a verifier reads the tokens alone, so at a
    production vocabulary no ``[k, V]`` row is made per request per step."""

    deterministic = True
    proposes = True

    @abstractmethod
    def draft_tokens(self, rid: str, k: int) -> list[int]:
        """At most ``k`` draft tokens continuing what the handle holds for ``rid``; appended to it."""

    def propose(self, rid: str, k: int) -> tuple[list[int], torch.Tensor]:
        toks = self.draft_tokens(rid, k)
        return toks, onehot_logits(toks, self.vocab_size)                # [L <= k], [L, V]

    def propose_batch(self, items) -> list[tuple[list[int], torch.Tensor | None]]:
        out = []
        for it in items:
            toks = self.draft_tokens(it[0], it[1])
            out.append((toks, onehot_logits(toks, self.vocab_size) if rows_asked(it) else None))
        return out


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
