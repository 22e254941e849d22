"""The SpecDec++ stopping rule (Huang et al., *SpecDec++: Boosting Speculative Decoding via Adaptive Candidate
Lengths*, Algorithm 1 and footnote 1): when to stop drafting, from the acceptance head's predictions.

One implementation, used one candidate at a time by the drafters (:class:`DraftStop`, the batched worker's
``propose_adaptive_batch``) and over a whole list by :func:`stop_after`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

DEFAULT_THRESHOLD = 0.5


@dataclass
class DraftStop:
    """The stopping rule for one draft (Huang et al. 2024, SpecDec++, Algorithm 1): at iteration i >= 2 the
    forward pass that yields q_i also yields e_{i-1}, so the head's acceptance a_{i-1} of candidate i-1 arrives
    with candidate i; after sampling Y_i the cumulative acceptance is prod_{j<i} a_j, and drafting stops
    (keeping Y_i) once 1 - prod > ``threshold``.  Drafting also stops at ``k_max`` candidates and, per the
    paper's footnote 1 ("when Y_{k+1} is EOS ... we manually set a = stop"), right after a candidate that is
    ``eos`` (None: no EOS stop, e.g. a request that ignores EOS).

    Worked example: threshold 0.3, a = 0.9, 0.8, 0.5: keep 0.9 at i = 2, 0.72 at i = 3, 0.36 at i = 4, where
    1 - 0.36 > 0.3: four candidates.
    """

    threshold: float
    k_max: int
    eos: int | None = None
    drafted: int = 0          # candidates so far
    keep: float = 1.0         # prod of the predicted acceptances read so far

    def after(self, token: int, accept_prev: float | None) -> bool:
        """Record candidate i = ``drafted + 1`` (``token``) and, for i >= 2, ``accept_prev`` = a_{i-1} from the
        same forward pass; True = stop drafting now (candidate i is kept)."""
        self.drafted += 1
        if self.drafted >= 2 and accept_prev is not None:
            self.keep *= float(accept_prev)
        return (self.drafted >= self.k_max or (self.eos is not None and int(token) == self.eos)
                or (self.drafted >= 2 and 1.0 - self.keep > self.threshold))


def stop_after(accept_probs: Sequence[float], threshold: float, k_max: int, tokens: Sequence[int] | None = None,
               eos: int | None = None) -> int:
    """Draft length under :class:`DraftStop`: ``accept_probs[j]`` is a_{j+1}, the predicted acceptance of
    candidate j+1; ``tokens[j]`` candidate j+1 (only read for the EOS stop)."""
    rule = DraftStop(threshold, k_max, eos)
    for i in range(1, k_max + 1):
        token = tokens[i - 1] if tokens is not None and i - 1 < len(tokens) else -1
        if rule.after(token, accept_probs[i - 2] if i >= 2 else None):
            return i
    return k_max
