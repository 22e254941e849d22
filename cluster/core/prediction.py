"""Predicted outputs (OpenAI's ``prediction`` parameter): the text a client expects back, e.g. the file it asks
to edit, as a per-request Max-Gram index that every drafting strategy draws from.

The prediction is indexed once with :class:`cluster.core.maxgram.MaxGramIndex` (n-gram -> end positions in the
prediction).  Each step, :meth:`Prediction.draft` finds the longest suffix of the tokens generated so far that
occurs in the prediction and proposes what follows it there (Chen et al., *Cascade Speculative Drafting for
Even Faster LLM Inference*, section 3.3: the Max-Gram rule, with the prediction as the text searched); before
the first generated token it proposes the prediction's start.  Among the occurrences of the match it prefers
the first one past where the last prediction draft started (an edit keeps the file's order, so repeated
lines such as ``return x`` do not send the draft back to an earlier copy), else the latest one before.

A prediction-backed draft is deterministic (one-hot q), so verifying it is exact speculative sampling with a
deterministic drafter (Leviathan et al., *Fast Inference from Transformers via Speculative Decoding*,
Algorithm 1 with q one-hot: accept x w.p. min(1, p(x)), recover from norm(max(0, p - onehot(x)))): the output
law is the target's whatever the prediction says; a wrong prediction costs only rejected drafts.  Where no
suffix of at least ``min_match`` tokens occurs in the prediction the strategy's own drafter drafts.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

from cluster.core.maxgram import MaxGramIndex

PREDICTION_NGRAM = 8          # longest n-gram indexed (a match that long already pins the position)
PREDICTION_K = 8              # draft tokens per prediction-backed step (drafts cost nothing; verifying more does)
MIN_MATCH = 2                 # shortest generated suffix that must occur in the prediction to draft from it


class Prediction:
    """One request's predicted output ``ids`` (token ids), indexed once; ``offset``: the prompt's length (the
    sequence's tokens from there on are the generated ones)."""

    def __init__(self, ids: Sequence[int], offset: int = 0, *, max_ngram: int = PREDICTION_NGRAM,
                 k: int = PREDICTION_K, min_match: int = MIN_MATCH):
        self.ids, self.offset = [int(t) for t in ids], offset
        self.index = MaxGramIndex(self.ids, max_ngram)       # holds n-grams with a token after them
        self.k, self.min_match = k, min_match
        self.cursor = 0                                        # where the last prediction draft started

    def __len__(self) -> int:
        return len(self.ids)

    def match(self, generated: Sequence[int]) -> int | None:
        """The prediction position from which to copy, given the tokens ``generated`` so far (or their last
        ``max_ngram`` at least; None: no suffix of at least ``min_match`` tokens occurs in the prediction with a
        token after it)."""
        if not generated:
            return 0 if self.ids else None
        table, gen = self.index.table, list(generated[-self.index.max_ngram:])
        lo, hi, hits = 1, len(gen), None
        while lo <= hi:                  # monotone: a suffix of n that occurs implies one of n - 1 that does
            mid = (lo + hi) // 2
            hit = table.get(tuple(gen[len(gen) - mid:]))
            if hit is None:
                hi = mid - 1
            else:
                hits, n, lo = hit, mid, mid + 1
        if hits is None or n < min(self.min_match, len(generated)):
            return None
        i = bisect_left(hits, self.cursor)             # each step emits >= 1 token: the match moved on
        e = hits[i] if i < len(hits) else hits[-1]
        return e + 1

    def draft(self, tokens: Sequence[int], limit: int) -> list[int]:
        """At most ``min(limit, k)`` tokens copied from the prediction after the matched suffix of the sequence
        ``tokens`` (prompt + generated; only the generated part is matched) ([]: none)."""
        tail = tokens[max(self.offset, len(tokens) - self.index.max_ngram):]     # all a match can use
        start = self.match(tail) if limit > 0 else None
        if start is None:
            return []
        out = self.ids[start:start + min(limit, self.k)]
        self.cursor = start
        return out
