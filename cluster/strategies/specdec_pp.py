"""SpecDec++ (Huang et al., *SpecDec++: Boosting Speculative Decoding via Adaptive Candidate Lengths*,
Algorithm 1): speculative sampling with an adaptive draft length.

The drafter proposes until its acceptance-prediction head (:mod:`cluster.models.head`) predicts that
some candidate is rejected with probability above ``threshold``, at most ``k_max`` tokens; then the
target verifies as in plain speculative sampling.  Drafting also stops right after an EOS candidate (the
paper's footnote 1; not for a request that ignores EOS).  The stopping rule
(:class:`cluster.core.draft.stop.DraftStop`, the one implementation the drafters run) looks only at the
drafted tokens (a stopping time), so verification stays lossless.  ``threshold = 1`` never stops early
(but at EOS): fixed k = k_max.

The head is chosen BY NAME: option ``head`` names a drafter whose acceptance head the served models carry
(built with the zoo, ``specserve train-head``), i.e. the chosen drafter's own; default: the chosen drafter's.
No request option names a file, in-process or through the servers: a head is attached to its drafter's
handle by the builder (:mod:`cluster.models.build`).
"""
from __future__ import annotations

from cluster.core.draft.stop import DEFAULT_THRESHOLD
from cluster.core.draft.programs import DRAFTS, DraftSpec
from cluster.core.verifiers import VERIFIERS
from cluster.errors import ParamError
from cluster.strategies.base import Option, StepContext, Strategy, register
from cluster.strategies.speculative import DRAFTER, VERIFY, speculative_step

K_MAX = Option("k_max", int, 12, "SpecDec++: hard cap on draft tokens per step", low=1, high=64)
THRESHOLD = Option("threshold", float, DEFAULT_THRESHOLD, "SpecDec++: stop drafting once P(some candidate rejected) > h",
                   low=0.0, high=1.0)
HEAD = Option("head", str, None, "SpecDec++: the acceptance head, by drafter name: the chosen drafter's built "
              "head (default); naming another drafter's head picks that drafter")


@register
class SpecDecPP(Strategy):
    name = "specdec_pp"
    help = "speculative decoding whose draft length is chosen per step by a trained acceptance head"
    options = (DRAFTER, K_MAX, THRESHOLD, HEAD, VERIFY)
    constrained = True

    def __init__(self, opts, models, target):
        super().__init__(opts, models, target)
        head = opts["head"]
        if opts["drafter"] or not head:
            self.drafter = self.check_drafter(opts["drafter"] or self.drafter_names()[0])
        else:                                                        # the head's name picks its drafter
            self.drafter = self.check_drafter(head, "head")
        handle = models[self.drafter]
        if not handle.adaptive:
            raise ParamError("drafter", "a neural drafter (with propose_adaptive_batch)", self.drafter)
        self.head = self.head_by_name(head or self.drafter)
        self.k_max, self.threshold = opts["k_max"], opts["threshold"]
        self.verify = VERIFIERS[opts["verify"]]

    def served_heads(self) -> dict[str, str]:
        """Drafter name -> its acceptance head, for the served drafters that carry one."""
        return {n: h for n in self.drafter_names() if (h := self.models[n].specdec_head)}

    def head_by_name(self, name: str) -> str:
        """The head of drafter ``name``, which must be the chosen drafter and carry a built head."""
        heads = self.served_heads()
        built = ", ".join(sorted(heads)) or "none is built (`specserve train-head`)"
        if name != self.drafter:
            raise ParamError("head", f"the chosen drafter {self.drafter}'s head (a head is per drafter; "
                             f"drafters with a head: {built})", name)
        if name not in heads:
            raise ParamError("head", f"a drafter with a built acceptance head: {built}", name)
        return heads[name]

    def roles(self) -> list[str]:
        return [self.target_name, DRAFTS]

    def draft_members(self) -> tuple[str, ...]:
        return (self.drafter,)

    def step(self, ctx: StepContext):
        spec = DraftSpec("adaptive", (self.drafter,), head=self.head, threshold=self.threshold, eos=ctx.eos)
        return speculative_step(ctx, spec, min(self.k_max, ctx.budget - 1), self.verify)
