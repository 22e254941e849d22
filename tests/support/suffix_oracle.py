"""An independent oracle for the suffix index (tests only): occurrences counted by rescanning every document."""
from __future__ import annotations

from collections import Counter
from typing import Sequence


def occurrences(docs: Sequence[Sequence[int]], window: Sequence[int], max_depth: int) -> tuple[int, Counter]:
    """(occurrences of ``window`` in ``docs``, the tokens that followed them within windows of ``max_depth``)."""
    n, w, seen, after = len(window), list(window), 0, Counter()
    for d in docs:
        for end in range(n - 1, len(d)):
            if list(d[end - n + 1:end + 1]) == w:
                seen += 1
                if end + 1 < len(d) and n < max_depth:
                    after[d[end + 1]] += 1
    return seen, after


def check_draft(docs, context, got, k, max_depth, min_prob, spec_factor) -> None:
    """Assert ``got`` is a draft by the definition (cluster/core/suffix.py), with any of equally frequent tokens
    where they tie: the longest suffix of ``context`` followed by something, its most frequent continuations while
    their probabilities' product stays >= ``min_prob``, at most ``min(k, spec_factor * p)`` tokens, and no more
    when the next would qualify."""
    p = next((q for q in range(min(max_depth - 1, len(context)), 0, -1)
              if occurrences(docs, context[-q:], max_depth)[1]), 0)
    if p == 0:
        assert got == [], got
        return
    limit = min(k, int(spec_factor * p))
    assert len(got) <= limit, (got, limit)
    w, score = list(context[-p:]), 1.0
    for tok in got:
        w = w[1:] if len(w) == max_depth else w
        after = occurrences(docs, w, max_depth)[1]
        assert after[tok] == max(after.values()), (w, tok, after)
        score *= after[tok] / sum(after.values())
        assert score >= min_prob
        w = w + [tok]
    if len(got) < limit:
        w = w[1:] if len(w) == max_depth else w
        after = occurrences(docs, w, max_depth)[1]
        assert not after or score * (max(after.values()) / sum(after.values())) < min_prob, (w, after, score)
