"""Incremental detokenisation with stop strings (what a stream may emit, and where a stop string ends it).

Linear in the output: every token is decoded once, by the tokenizer's :class:`TextStream` (``DecodeStream``
for Hugging Face tokenizers), and stop strings are searched only in text not yet emitted, which is the new
text plus a held-back suffix of at most ``max(len(stop)) - 1`` characters (a suffix that may still begin a
stop string).  Emitted text therefore never contains the start of a stop string.
"""
from __future__ import annotations

from bisect import bisect_left

from cluster.core.interfaces import Tokenizer


class StopDecoder:
    """Incremental detokenisation with stop strings: emits only text that can no longer change."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]):
        self.stream, self.stop = tokenizer.stream(), stop
        self._emitted: list[str] = []   # pieces handed out so far (their concatenation: the text so far)
        self._held = ""                 # decoded, not yet handed out: it may begin a stop string
        self._ends: list[int] = []      # [N] characters decoded after each token (non-decreasing)
        self._decoded = 0               # characters decoded over all tokens
        self.searched = 0               # characters searched for stop strings (a linear-time witness)
        self.stopped = False

    @property
    def text(self) -> str:
        """The text so far (the result's text once the request ended)."""
        return "".join(self._emitted)

    def push(self, new: list[int]) -> tuple[str, int | None]:
        """Decode this step's ``new`` ids; return (the text that is safe to emit now, and, if a stop string
        was hit, how many of all the ids pushed so far to keep: the fewest whose streamed text contains it;
        a token that ends inside a character streams its text with the token that completes it)."""
        base = self._decoded - len(self._held)        # characters of text before ``_held``
        for i in new:
            piece = self.stream.step(i)
            self._held += piece
            self._decoded += len(piece)
            self._ends.append(self._decoded)
        self.searched += len(self._held) * len(self.stop)
        hits = [(at, at + len(s)) for s in self.stop if (at := self._held.find(s)) >= 0]
        if hits:
            start, end = min(h[0] for h in hits), min(h[1] for h in hits)
            self._held, self.stopped = self._held[:start], True
            return self._emit(len(self._held)), bisect_left(self._ends, base + end) + 1
        return self._emit(len(self._held) - self._partial()), None

    def flush(self) -> str:
        """At the end: everything held back, and any incomplete character (as U+FFFD); nothing after a stop."""
        if not self.stopped:
            self._held += self.stream.flush()
        return self._emit(len(self._held))

    def _partial(self) -> int:
        """Length of the longest suffix of the held text that is a proper prefix of a stop string."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(self._held)), 0, -1)
                    if self._held.endswith(s[:n])), default=0)

    def _emit(self, n: int) -> str:
        out, self._held = self._held[:n], self._held[n:]
        if out:
            self._emitted.append(out)
        return out
