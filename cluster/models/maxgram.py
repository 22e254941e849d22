"""The Max-Gram drafter behind the model-handle interface, and its bigram table on disk."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from cluster.core.interfaces import DeterministicDrafter, UnknownRequestError
from cluster.core.maxgram import DEFAULT_MAX_NGRAM, MaxGramIndex
from cluster.core.sampling import SamplingParams, onehot_logits


def save_bigram(table: np.ndarray, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, np.asarray(table, dtype=np.int32))
    tmp.replace(path)
    return path


def load_bigram(path: str | Path) -> np.ndarray:
    return np.load(Path(path)).astype(np.int64)


# -- MaG as a model handle ----------------------------------------------------------------------
class MagHandle(DeterministicDrafter):
    """The MaG drafter behind the :class:`cluster.core.interfaces.BatchedHandle` interface (per-request work:
    the batched forms come from :class:`cluster.core.interfaces.PerRequestHandle`).

    Its proposals are deterministic (:class:`cluster.core.interfaces.DeterministicDrafter`: one-hot rows only
    where a caller asks for them); ``score`` returns MaG's one-hot prediction at each
    of the L+1 positions (MaG as a deterministic "model").  ``num_params`` is the bigram table size
    (Chen et al., *Cascade Speculative Drafting for Even Faster LLM Inference*, section 5.2: "a bigram
    model with parameters equal to the tokenizer size"), so the standardized walltime improvement charges
    it (almost) nothing.
    """

    statistical = "maxgram"

    def __init__(self, vocab_size: int, bigram: np.ndarray | None = None, *, name: str = "mag",
                 max_ngram: int = DEFAULT_MAX_NGRAM, max_length: int = 1 << 30, occurrence: str = "recent"):
        self.name, self.vocab_size, self.max_length = name, int(vocab_size), max_length
        self.bigram = None if bigram is None else np.asarray(bigram, dtype=np.int64)
        if self.bigram is not None and (len(self.bigram) != self.vocab_size or
                                        (self.bigram.size and (self.bigram.min() < 0 or
                                                               self.bigram.max() >= self.vocab_size))):
            raise ValueError(f"mag: bigram table of {len(self.bigram)} entries does not match "
                             f"vocabulary size {self.vocab_size}")
        self.num_params = self.vocab_size
        self.max_ngram, self.occurrence = max_ngram, occurrence       # see cluster.core.maxgram (0: uncapped)
        MaxGramIndex((), max_ngram, occurrence)                         # validates both
        self._requests: dict[str, MaxGramIndex] = {}

    def _onehot(self, toks: list[int]) -> torch.Tensor:
        return onehot_logits(toks, self.vocab_size)                    # [n, V]

    def _get(self, rid: str) -> MaxGramIndex:
        try:
            return self._requests[rid]
        except KeyError:
            raise UnknownRequestError(self.name, rid) from None

    def prefill(self, rid: str, ids: list[int], sampling: SamplingParams | None = None, seed: int = 0) -> None:
        if not ids:
            raise ValueError("prefill needs at least one token")
        self._requests[rid] = MaxGramIndex(ids, self.max_ngram, self.occurrence)

    def draft_tokens(self, rid: str, k: int) -> list[int]:
        idx = self._get(rid)
        toks = idx.predict(k, self.bigram)
        idx.extend(toks)
        return toks                                                    # [k]

    def score(self, rid: str, draft: list[int]) -> torch.Tensor:
        idx = self._get(rid)
        preds = [idx.predict(1, self.bigram)[0]]
        for t in draft:
            idx.append(t)
            preds.append(idx.predict(1, self.bigram)[0])
        return self._onehot(preds)                                     # [L+1, V]

    def rollback(self, rid: str, length: int) -> None:
        self._get(rid).truncate(length)

    def extend(self, rid: str, ids: list[int]) -> None:
        self._get(rid).extend(ids)

    def release(self, rid: str) -> None:
        self._requests.pop(rid, None)

    def length(self, rid: str) -> int:
        return len(self._get(rid))

    def active_requests(self) -> list[str]:
        return list(self._requests)
