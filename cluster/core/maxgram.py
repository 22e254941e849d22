"""The Max-Gram (MaG) drafter: a statistical language model that costs (almost) nothing to run.

Chen et al., *Cascade Speculative Drafting for Even Faster LLM Inference*, section 3.3 and appendix A: find the
longest suffix of the current sequence (prompt + generated) that occurred earlier in it and copy the tokens
that followed that occurrence; where that yields fewer than k tokens, continue greedily from a bigram
table (each token's most frequent successor in a corpus).

Unlike the paper's listing (a rescan of the whole sequence per call), :class:`MaxGramIndex` keeps an
incremental index: a dict from every n-gram (n <= ``max_ngram``) to the end positions where it
occurs, updated per appended token in O(max_ngram) and undone per removed token on rollback.  The
longest earlier match is then a binary search over n (if a suffix of length n occurred earlier, so did
its suffix of length n - 1), so a proposal costs O(log(max_ngram) * max_ngram + k * max_ngram)
independent of the context length.

Two readings of "copy what followed the match", named by ``occurrence`` and ``max_ngram``:

* ours (the default): the *most recent* earlier occurrence of the longest suffix match, matches capped at
  ``max_ngram`` = 24 tokens (recent context predicts better; the cap bounds the index);
* the paper's (appendix A, Listing 1: ``torch_index(..., 1)`` takes the first match): the *first* earlier
  occurrence (``occurrence="first"``), of a match of any length (``max_ngram=0``: the table indexes
  :data:`DEFAULT_MAX_NGRAM`-grams and a match that long is extended by comparing tokens backwards at each of
  its occurrences, so the longest match is found exactly).

:class:`cluster.models.maxgram.MagHandle` exposes MaG through the :class:`cluster.core.interfaces.BatchedHandle`
interface, so a strategy treats it like any drafter: its proposals come with one-hot "distributions" (logits 0 for
the proposed token, -inf elsewhere), so verification against it is exact speculative sampling with a
deterministic drafter (accept x w.p. min(1, p(x)), recover from norm(max(0, p - onehot(x)))).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

DEFAULT_MAX_NGRAM = 24
OCCURRENCES = ("recent", "first")     # which earlier occurrence of the longest suffix match is copied


# -- the incremental index ----------------------------------------------------------------------
class MaxGramIndex:
    """Token sequence plus an index of n-gram -> end positions (ascending), n <= ``max_ngram``
    (``max_ngram=0``: n <= ``table_ngram`` in the table, matches uncapped).  ``occurrence``: copy
    after the ``"recent"`` (latest) or ``"first"`` earlier occurrence of the longest match.

    Invariant: once :meth:`_sync` has run (every query runs it), the index holds exactly the n-grams ending at
    positions ``<= len(seq) - 2``, so any hit for a suffix of the sequence is an *earlier* occurrence (never the
    suffix itself).  Appended tokens are indexed lazily, at the next query: a drafter's own drafts are appended
    and mostly rolled back before anything asks, and indexing each of them only to undo it was most of the
    index's work.
    """

    def __init__(self, ids: Sequence[int] = (), max_ngram: int = DEFAULT_MAX_NGRAM, occurrence: str = "recent",
                 *, table_ngram: int = DEFAULT_MAX_NGRAM):
        if occurrence not in OCCURRENCES or max_ngram < 0 or table_ngram < 1:
            raise ValueError(f"MaxGramIndex: occurrence in {OCCURRENCES}, max_ngram >= 0 (0: uncapped); "
                             f"got {occurrence!r}, {max_ngram}")
        self.capped = max_ngram > 0
        self.max_ngram = max_ngram if self.capped else table_ngram       # the table's n-gram limit
        self.first = occurrence == "first"
        self.seq: list[int] = []
        self._table: dict[tuple[int, ...], list[int]] = {}
        self._ends = 0                               # end positions 0 .. _ends - 1 are indexed
        self.extend(ids)

    def __len__(self) -> int:
        return len(self.seq)

    @property
    def table(self) -> dict[tuple[int, ...], list[int]]:
        """n-gram -> its end positions (ascending), brought up to date with the sequence."""
        self._sync()
        return self._table

    def _sync(self) -> None:
        """Index the end positions appended since the last query (every end up to ``len(seq) - 2``)."""
        while self._ends < len(self.seq) - 1:
            self._index_end(self._ends)
            self._ends += 1

    def _index_end(self, e: int) -> None:
        seq, table = self.seq, self._table
        for n in range(1, min(self.max_ngram, e + 1) + 1):
            key = tuple(seq[e - n + 1:e + 1])
            hit = table.get(key)
            if hit is None:
                table[key] = [e]
            else:
                hit.append(e)

    def _unindex_end(self, e: int) -> None:
        seq, table = self.seq, self._table
        for n in range(1, min(self.max_ngram, e + 1) + 1):
            key = tuple(seq[e - n + 1:e + 1])
            hit = table[key]
            hit.pop()                               # e is the largest indexed end: the list's last
            if not hit:
                del table[key]

    def append(self, tok: int) -> None:
        self.seq.append(int(tok))

    def extend(self, ids: Iterable[int]) -> None:
        self.seq.extend(int(t) for t in ids)

    def truncate(self, length: int) -> None:
        """Drop tokens from position ``length`` on (undoing the index entries of those that were indexed)."""
        length = max(0, length)
        while self._ends > max(0, length - 1):
            self._ends -= 1
            self._unindex_end(self._ends)
        del self.seq[length:]

    def longest_match(self) -> tuple[int, int]:
        """(n, e): the longest suffix length n that also ends at an earlier position, and the latest (or,
        with ``occurrence="first"``, the first) such end position e (``<= len - 2``); (0, -1) when even the
        last token never occurred before."""
        seq, table = self.seq, self.table                                # synced
        N = len(seq)
        lo, hi, best, hits = 1, min(self.max_ngram, N - 1), (0, -1), None
        while lo <= hi:                              # monotone: a match of n implies one of n - 1
            mid = (lo + hi) // 2
            hit = table.get(tuple(seq[N - mid:]))
            if hit is None:
                hi = mid - 1
            else:
                best, hits, lo = (mid, hit[0] if self.first else hit[-1]), hit, mid + 1
        if not self.capped and best[0] == self.max_ngram:       # uncapped: extend at every occurrence
            best = max(((self._match_len(e), -e if self.first else e) for e in hits))
            best = (best[0], abs(best[1]))
        return best

    def _match_len(self, e: int) -> int:
        """Length of the common suffix of ``seq[:e + 1]`` and the whole sequence (e <= len - 2)."""
        seq, N, n = self.seq, len(self.seq), 0
        while n <= e and seq[e - n] == seq[N - 1 - n]:
            n += 1
        return n

    def predict(self, k: int, bigram: np.ndarray | None) -> list[int]:
        """k draft tokens: copy what followed the longest earlier match, then bigram continuation."""
        if k <= 0 or not self.seq:
            return []
        n, e = self.longest_match()
        out = self.seq[e + 1:e + 1 + k] if n > 0 else []
        last = out[-1] if out else self.seq[-1]
        while len(out) < k:
            last = int(bigram[last]) if bigram is not None and 0 <= last < len(bigram) else last
            out.append(last)
        return out

