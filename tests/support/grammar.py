"""A tiny grammar for exact enumeration: a DFA over a 4-token vocabulary behind the
:class:`cluster.core.constraint.Grammar` / ``Constraint`` protocols, and the exact law of constrained
autoregressive sampling from a tabular target (what every lossless strategy must emit under it).

Tokens 0, 1, 2 and 3 (3 plays end of text: allowed in accepting states, and the only token after a
forbidden sequence, as :mod:`cluster.models.grammar` does).  Every state forbids at least one token, so the
mask bites at every position.
"""
from __future__ import annotations

import torch

from cluster.core.constraint import mask_logits
from cluster.core.sampling import UNSCALED, logits_to_probs

V = 4
END = 3
# state -> {token: next state}
DFA = {0: {0: 1, 1: 2}, 1: {2: 0, 1: 1, END: 1}, 2: {0: 2, 2: 1, END: 0}}


class DfaConstraint:
    """One request's DFA state, moved to whatever sequence it is asked about (as the real one is)."""

    def __init__(self, start: int):
        self.start, self.calls = start, 0

    def allowed(self, tokens) -> torch.Tensor:
        self.calls += 1
        state = 0
        for tok in list(tokens)[self.start:]:
            state = DFA[state].get(tok) if state is not None else None
        out = torch.zeros(V, dtype=torch.bool)
        out[list(DFA[state]) if state is not None else [END]] = True
        return out


class DfaGrammar:
    field = "response_format"

    def start(self, prompt_length: int) -> DfaConstraint:
        return DfaConstraint(prompt_length)


def valid(tokens) -> bool:
    state = 0
    for tok in tokens:
        state = DFA[state].get(tok)
        if state is None:
            return False
    return True


def constrained_joint(model, prompt: list[int], n: int, sampling=None) -> dict:
    """Exact law of the first ``n`` tokens of constrained autoregressive sampling from ``model``: at every
    prefix the target's logits masked by the DFA, then the request's sampling."""
    sampling = sampling or UNSCALED
    c = DfaConstraint(len(prompt))
    out = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, w in out.items():
            full = list(prompt) + list(seq)
            p = logits_to_probs(mask_logits(model.logits(full), c.allowed(full)), sampling).tolist()
            for tok, pt in enumerate(p):
                if pt > 0:
                    nxt[seq + (tok,)] = w * pt
        out = nxt
    return out
