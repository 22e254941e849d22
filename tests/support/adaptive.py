"""A tabular drafter with SpecDec++'s adaptive drafting, for exact enumeration (tests only).

Its acceptance "head" predicts a constant ``accept`` for every candidate; the stopping rule is the production
one, :class:`cluster.core.draft.stop.DraftStop` (threshold, k_max, EOS).
"""
from __future__ import annotations

import torch

from cluster.core.constraint import mask_logits
from cluster.core.draft.stop import DraftStop
from cluster.core.sampling import logits_to_probs, sample
from tests.support.exact import TabularModel


class AdaptiveTabular(TabularModel):
    specdec_head = "constant"            # what SpecDecPP looks up by drafter name
    adaptive = True

    def __init__(self, name: str, vocab: int, seed: int, accept: float, **kw):
        super().__init__(name, vocab, seed, **kw)
        self.accept = accept

    def propose_adaptive(self, rid, k_max, head, threshold, eos=None):
        rule = DraftStop(threshold, k_max, eos)
        seq, out, logits = self.seqs[rid], [], []
        constraint = getattr(self.sampling[rid], "constraint", None)
        while k_max > 0:
            lg = self.logits(seq)
            if constraint is not None:          # a grammar's law, as the worker samples it (core/constraint.py)
                lg = mask_logits(lg, constraint.allowed(seq))
            tok = sample(logits_to_probs(lg, self.sampling[rid]), self.rng)
            seq.append(tok)
            out.append(tok)
            logits.append(lg)
            if rule.after(tok, self.accept if len(out) >= 2 else None):
                break
        self.forwards += len(out)
        return out, torch.stack(logits) if logits else torch.empty(0, self.vocab_size)
