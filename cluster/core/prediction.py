"""Predicted outputs (OpenAI's ``prediction`` parameter): the text a client expects back, e.g. the file it asks
to edit, as a per-request Max-Gram index that every drafting strategy draws from.

The prediction is indexed once with :class:`cluster.core.maxgram.MaxGramIndex` (n-gram -> end positions in the
prediction).  A prediction *continues* a sequence where the longest suffix of its generated part (at least
``min_match`` tokens) occurs in the prediction: it proposes what follows that occurrence there (Chen et al.,
*Cascade Speculative Drafting for Even Faster LLM Inference*, section 3.3: the Max-Gram rule, with the prediction
as the text searched); while fewer tokens than that were generated, only where they all are the prediction's
start (before the first generated token: the prediction's start).  Among the occurrences of the match it prefers
the first one ending past where the sequence stood in the prediction at the last prediction draft (an edit keeps
the file's order, so repeated lines such as ``return x`` do not send the draft back to an earlier copy), else
the latest one.

**How a step uses it** (:func:`cluster.strategies.speculative.speculative_step`), so that a prediction the
output does not follow costs (almost) nothing and one it follows replaces the drafter.  Each request counts its
prediction tokens verification accepted and refused (OpenAI's accepted / rejected prediction tokens):

* *following* (until verification has seen prediction tokens, and while it has refused more than it accepted):
  the strategy's own drafter drafts as without a prediction; where that whole draft, with the token before it,
  matches the prediction (the drafter agrees with it; the last ``max_ngram`` tokens of a longer draft), the
  block is **extended** by the prediction's continuation (:meth:`Prediction.follow`): a few more positions in
  the target's one pass, no model call.  Where the generated tokens re-synchronised with the prediction (their
  last ``max_ngram`` match it, or all of them if fewer), the prediction's continuation alone is the block;
* *leading* (verification accepted at least as many prediction tokens as it refused): the block is the
  prediction's continuation alone wherever ``min_match`` tokens match (:meth:`Prediction.lead`); the drafter is
  not asked.  Where nothing matches (e.g. just after an edit) the drafter drafts, extended as above.

``min_match`` adapts per request: a prediction block mostly refused (under half its prediction tokens
accepted) doubles it, up to ``max_ngram``; one mostly accepted halves it back toward :data:`MIN_MATCH`.  So a
prediction the output does not follow never replaces the drafter but on a ``max_ngram`` match, and adds
positions to the drafter's blocks less and less often.

Prediction tokens are deterministic functions of the sequence (one-hot q), so a block made or extended by them
is verified exactly as a deterministic drafter's (Leviathan et al., *Fast Inference from Transformers via
Speculative Decoding*, Algorithm 1: each x_i drawn from q_i given everything before it; q_i one-hot: accept
w.p. min(1, p(x)), recover from norm(max(0, p - onehot(x)))); which rule makes a block depends only on the
request's past (its emitted tokens and their verdicts), never on the draws that verify it: the output law is the
target's whatever the prediction says.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

from cluster.core.maxgram import MaxGramIndex

PREDICTION_NGRAM = 8          # longest n-gram indexed (a match that long already pins the position)
PREDICTION_K = 8              # tokens per prediction continuation (drafts cost nothing; verifying more does)
MIN_MATCH = 2                 # shortest generated suffix that must occur in the prediction to draft from it


class Prediction:
    """One request's predicted output ``ids`` (token ids), indexed once; ``offset``: the prompt's length (the
    sequence's tokens from there on are the generated ones)."""

    def __init__(self, ids: Sequence[int], offset: int = 0, *, max_ngram: int = PREDICTION_NGRAM,
                 k: int = PREDICTION_K, min_match: int = MIN_MATCH):
        self.ids, self.offset = [int(t) for t in ids], offset
        self.index = MaxGramIndex(self.ids, max_ngram)       # holds n-grams with a token after them
        self.k, self.base = k, min_match
        self.min_match = min_match                             # adapts: see the module docstring
        self.drafted = self.accepted = 0                       # its tokens drafted / accepted so far
        self.cursor = 0                                        # where the sequence stood in the prediction

    def __len__(self) -> int:
        return len(self.ids)

    def match(self, tail: Sequence[int], need: int) -> tuple[int, int] | None:
        """(start, n): the prediction position from which to copy and the length n of the longest suffix of
        ``tail`` (its last ``max_ngram`` tokens) that occurs in the prediction with a token after it; None: none
        of at least ``need`` tokens."""
        table, gen = self.index.table, list(tail[-self.index.max_ngram:])
        lo, hi, hits = 1, len(gen), None
        while lo <= hi:                  # monotone: a suffix of n that occurs implies one of n - 1
            mid = (lo + hi) // 2
            hit = table.get(tuple(gen[len(gen) - mid:]))
            if hit is None:
                hi = mid - 1
            else:
                hits, n, lo = hit, mid, mid + 1
        if hits is None or n < need:
            return None
        i = bisect_left(hits, self.cursor)             # the output moves forward through the prediction
        e = hits[i] if i < len(hits) else hits[-1]
        return e + 1, n

    def _continue(self, tokens: Sequence[int], draft: Sequence[int], limit: int, need: int) -> list[int]:
        """At most ``min(limit, k)`` tokens the prediction continues ``tokens`` (prompt + generated) followed
        by ``draft`` with, where a suffix of at least ``need`` of those tokens matches -- or, where fewer than
        ``need`` were generated and drafted, where they all are the prediction's start ([]: none).  Remembers
        where the sequence ends in the prediction (the next step's match ends past it)."""
        generated = len(tokens) - self.offset
        if limit <= 0:
            return []
        if generated + len(draft) < need:
            head = list(tokens[self.offset:]) + list(draft)
            if head != self.ids[:len(head)]:
                return []
            start = len(head)
        else:
            found = self.match(list(tokens[max(self.offset, len(tokens) - self.index.max_ngram):]) + list(draft),
                               need)
            if found is None:
                return []
            start = found[0]
        self.cursor = max(0, start - len(draft))
        return self.ids[start:start + min(limit, self.k)]

    def follow(self, tokens: Sequence[int], draft: Sequence[int], limit: int) -> list[int]:
        """The prediction's continuation of ``tokens`` + the drafter's ``draft``, where the whole draft and the
        token before it match (or the last ``max_ngram`` tokens, a longer draft): an extension of that draft."""
        need = max(self.min_match, min(len(draft) + 1, self.index.max_ngram))
        return self._continue(tokens, draft, limit, need) if draft else []

    @property
    def leading(self) -> bool:
        """Whether the prediction leads: verification has seen its tokens, and accepted at least as many of them
        as it refused."""
        return self.drafted > 0 and 2 * self.accepted >= self.drafted

    def lead(self, tokens: Sequence[int], limit: int) -> list[int]:
        """The prediction's continuation of ``tokens`` alone: while leading, where ``min_match`` tokens match;
        else only where the output re-synchronised with the prediction (a match of ``max_ngram`` tokens, or
        every generated token, if fewer, equal to the prediction's start) ([]: none)."""
        if self.leading:
            return self._continue(tokens, (), limit, self.min_match)
        return self._continue(tokens, (), limit, self.index.max_ngram) if len(tokens) > self.offset else []

    def verified(self, drafted: int, accepted: int) -> None:
        """Verification accepted ``accepted`` of the ``drafted`` prediction tokens of a block: count them, and
        adapt ``min_match`` (module docstring)."""
        if drafted <= 0:
            return
        self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted
        if 2 * accepted < drafted:
            self.min_match = min(2 * self.min_match, self.index.max_ngram)
        else:
            self.min_match = max(self.base, self.min_match // 2)
