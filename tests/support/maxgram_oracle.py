"""An independent oracle for the Max-Gram index (tests only)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from cluster.core.maxgram import DEFAULT_MAX_NGRAM


def brute_force_predict(seq: Sequence[int], k: int, bigram: np.ndarray | None,
                        max_ngram: int = DEFAULT_MAX_NGRAM, occurrence: str = "recent") -> list[int]:
    """Reference implementation of :meth:`cluster.core.maxgram.MaxGramIndex.predict` by rescanning: an
    independent oracle, the literal definition (longest suffix match, its most recent or first earlier
    occurrence, then the bigram chain)."""
    seq = list(seq)
    N = len(seq)
    if k <= 0 or N == 0:
        return []
    out: list[int] = []
    for n in range(min(max_ngram or N, N - 1), 0, -1):
        ends = [e for e in range(n - 1, N - 1) if seq[e - n + 1:e + 1] == seq[N - n:]]
        if ends:
            e = ends[0] if occurrence == "first" else ends[-1]
            out = seq[e + 1:e + 1 + k]
            break
    last = out[-1] if out else seq[-1]
    while len(out) < k:
        last = int(bigram[last]) if bigram is not None and 0 <= last < len(bigram) else last
        out.append(last)
    return out
