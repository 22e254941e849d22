"""Speculative decoding with the suffix drafter alone (Oliaro et al., *SuffixDecoding: Extreme Speculative
Decoding for Emerging AI Applications*).

The drafter (:mod:`cluster.core.suffix`, :class:`cluster.models.suffix.SuffixHandle`) proposes the continuation of
the longest suffix of the context seen before in any recent request of the same ``cache_salt`` -- as many tokens
as how often that continuation was seen supports, none where nothing was -- so repetitive traffic (agent loops,
re-emitted files, resent conversations) gets long drafts for free and open chat loses little.  Its proposals
are deterministic functions of what was committed (one-hot q), so token verification accepts x w.p. p(x) and
recovers from p with x removed: exactly the target's law, whatever the index holds.
"""
from __future__ import annotations

from cluster.strategies.base import Option, register
from cluster.strategies.mag import find_statistical
from cluster.strategies.speculative import VERIFY, Speculative

# the most draft tokens per step; the index decides how many it has evidence for (cluster/core/suffix.py), so the
# cap only bounds what one verification may cost
K = Option("k", int, 16, "draft tokens per step at most (the suffix index drafts as many as its counts support)",
           low=1, high=64)


@register
class Suffix(Speculative):
    """:class:`Speculative` with the suffix drafter: the same step, another drafter and no drafter option."""

    name = "suffix"
    help = "speculative decoding with the suffix drafter (continuations of recent requests' outputs and prompts)"
    options = (K, VERIFY)
    constrained = True
    # its draft length follows the index's evidence (nothing where nothing was seen), not a fixed k, so the batch
    # size does not make its steps plain (engine.plain_from_batch); and every step it drafts tells the draft side
    # what was committed, so the index learns the whole output
    plain_steps = False

    def choose_drafter(self, opts) -> str:
        return find_statistical(self.models, "suffix", "suffix", "the suffix drafter")
