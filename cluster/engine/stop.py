"""Incremental detokenisation with stop strings (what a stream may emit, and where a stop string ends it)."""
from __future__ import annotations

from cluster.core.interfaces import Tokenizer


class StopDecoder:
    """Incremental detokenisation with stop strings: emits only text that can no longer change."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.text = ""            # final text so far (what the result reports)
        self.emitted = 0          # characters of ``text`` already handed out
        self._pending = ""

    def push(self, ids: list[int]) -> tuple[str, int | None]:
        """Decode ``ids``; return (new safe text, token count to keep if a stop string was hit)."""
        full = self.tokenizer.decode(ids)
        hits = [full.find(s) for s in self.stop if s in full]
        if hits:
            keep = len(ids)               # fewest tokens whose text already contains a stop string
            while keep > 1 and any(s in self.tokenizer.decode(ids[:keep - 1]) for s in self.stop):
                keep -= 1
            self.text = full[:min(hits)]
            self._pending = ""
            return self._take(), keep
        safe = full.rstrip("\ufffd")          # an incomplete UTF-8 sequence may still change
        for s in self.stop:                   # hold back a suffix that may start a stop string
            for n in range(min(len(s) - 1, len(safe)), 0, -1):
                if safe.endswith(s[:n]):
                    safe = safe[:-n]
                    break
        safe = safe if len(safe) >= self.emitted else full[:self.emitted]
        self.text, self._pending = safe, full[len(safe):]
        return self._take(), None

    def flush(self) -> str:
        self.text += self._pending
        self._pending = ""
        return self._take()

    def _take(self) -> str:
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out
