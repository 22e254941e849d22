"""The suffix drafter (SuffixDecoding) behind the model-handle interface: one cross-request index per handle."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.core.calls import PrefillItem
from cluster.core.interfaces import DeterministicDrafter, UnknownRequestError, UnsupportedCallError
from cluster.core.sampling import SamplingParams
from cluster.core.suffix import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MIN_PROB,
    DEFAULT_SPEC_FACTOR,
    SuffixIndex,
)


@dataclass
class _Req:
    seq: list[int]               # what the handle holds: committed tokens, then its own last proposals
    doc: int                     # its document in the index
    salt: str


class SuffixHandle(DeterministicDrafter):
    """Oliaro et al.'s SuffixDecoding drafter (:mod:`cluster.core.suffix`) as a deterministic drafter
    (:class:`cluster.core.interfaces.DeterministicDrafter`: q one-hot, verification exact) of at most k
    tokens -- as many as the index's frequencies support, none where nothing was seen -- and the handle never
    scores (it drafts only as a bottom drafter).

    Each request is one document of the index under its ``cache_salt`` (the prefill item's ``salt``): its prompt
    is indexed at prefill, its sequence as the handle holds it at each proposal (its own proposals are not indexed:
    the draft side rolls them back before it asks again), and its final sequence at release, after which it stays
    for later requests until evicted.  The draft side tells it the committed sequence before releasing it
    (:meth:`cluster.core.draft.side.DraftSide.release`).  ``num_params`` is 0: a proposal costs no model."""

    statistical = "suffix"        # which deterministic drafter (cluster/strategies/suffix.py finds it by this)

    def __init__(self, vocab_size: int, *, name: str = "suffix", max_depth: int = DEFAULT_MAX_DEPTH,
                 max_tokens: int = DEFAULT_MAX_TOKENS, spec_factor: float = DEFAULT_SPEC_FACTOR,
                 min_prob: float = DEFAULT_MIN_PROB, max_length: int = 1 << 30):
        if not (spec_factor > 0 and 0 <= min_prob <= 1):
            raise ValueError(f"suffix: spec_factor > 0 and min_prob in [0, 1], got {spec_factor}, {min_prob}")
        self.name, self.vocab_size, self.max_length = name, int(vocab_size), max_length
        self.num_params = 0
        self.spec_factor, self.min_prob = spec_factor, min_prob
        self.index = SuffixIndex(max_depth, max_tokens)
        self._requests: dict[str, _Req] = {}
        self._docs = 0

    def _get(self, rid: str) -> _Req:
        try:
            return self._requests[rid]
        except KeyError:
            raise UnknownRequestError(self.name, rid) from None

    # -- the handle protocol --------------------------------------------------------------------------
    def prefill_batch(self, items) -> None:
        for item in items:
            it = PrefillItem.of(item)
            self._start(it.rid, it.ids, it.salt)

    def prefill(self, rid: str, ids: list[int], sampling: SamplingParams | None = None, seed: int = 0) -> None:
        self._start(rid, ids, "")

    def _start(self, rid: str, ids, salt: str) -> None:
        if not ids:
            raise ValueError("prefill needs at least one token")
        self.release(rid)
        self._docs += 1
        req = self._requests[rid] = _Req(list(ids), self._docs, salt)
        self.index.sync(req.doc, salt, req.seq)

    def draft_tokens(self, rid: str, k: int) -> list[int]:
        req = self._get(rid)
        self.index.sync(req.doc, req.salt, req.seq)
        toks = self.index.draft(req.doc, k, min_prob=self.min_prob, spec_factor=self.spec_factor)
        req.seq.extend(toks)
        return toks                                                     # [L <= k]

    def score(self, rid: str, draft: list[int]) -> torch.Tensor:
        raise UnsupportedCallError(self.name, "score")

    def rollback(self, rid: str, length: int) -> None:
        del self._get(rid).seq[length:]

    def extend(self, rid: str, ids: list[int]) -> None:
        self._get(rid).seq.extend(ids)

    def release(self, rid: str) -> None:
        req = self._requests.pop(rid, None)
        if req is not None:                       # its sequence stays indexed for later requests
            self.index.sync(req.doc, req.salt, req.seq)
            self.index.finish(req.doc)

    def length(self, rid: str) -> int:
        return len(self._get(rid).seq)

    def active_requests(self) -> list[str]:
        return list(self._requests)
