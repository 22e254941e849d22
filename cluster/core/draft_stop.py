"""The SpecDec++ stopping rule (Huang et al., *SpecDec++: Boosting Speculative Decoding via Adaptive Candidate
Lengths*): the draft length implied by a head's predicted per-candidate acceptance probabilities."""
from __future__ import annotations

from typing import Sequence

DEFAULT_THRESHOLD = 0.5


def stop_after(accept_probs: Sequence[float], threshold: float, k_max: int) -> int:
    """Draft length of SpecDec++ (Huang et al. 2024, SpecDec++, Algorithm 1): at iteration i >= 2 the
    forward pass that yields q_i also yields e_{i-1}; after sampling Y_i the cumulative acceptance is
    prod_{j<i} a_j and drafting stops (keeping Y_i) once 1 - prod > ``threshold``; at most ``k_max``.
    ``accept_probs[j]`` is a_{j+1}, the predicted acceptance of candidate j+1."""
    keep = 1.0
    for i in range(2, k_max + 1):
        keep *= accept_probs[i - 2]
        if 1.0 - keep > threshold:
            return i
    return k_max
