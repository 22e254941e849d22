"""Speculative decoding with the Max-Gram (MaG) drafter alone (Chen et al., *Cascade Speculative Drafting
for Even Faster LLM Inference*, section 3.3).

MaG's proposals are deterministic (one-hot q), so token verification accepts x w.p. p(x) and
recovers from p with x removed: exact, at the cost of nothing but the target's forward passes.
"""
from __future__ import annotations

from cluster.core.drafting import DRAFTS, DraftSpec
from cluster.core.verifiers import VERIFIERS
from cluster.errors import ParamError
from cluster.strategies.base import StepContext, Strategy, register
from cluster.strategies.speculative import (
    PLAN,
    VERIFY,
    K,
    draft_length,
    speculative_step,
)

MAG_NAME = "mag"


def find_mag(models) -> str:
    """The name of the served MaG drafter (config section ``mag``): the deterministic drafter."""
    for name, m in models.items():
        if getattr(m, "deterministic", False):
            return name
    if MAG_NAME in models:
        return MAG_NAME
    raise ParamError("strategy", "a config with a `mag:` section (the Max-Gram drafter is not served)",
                     ", ".join(n for n in models if n != DRAFTS))


@register
class Mag(Strategy):
    name = "mag"
    help = "speculative decoding with the Max-Gram drafter (longest earlier match + bigram)"
    options = (K, VERIFY, PLAN)
    constrained = True

    def __init__(self, opts, models, target):
        super().__init__(opts, models, target)
        self.mag = find_mag(models)
        self.k = opts["k"]
        self.verify = VERIFIERS[opts["verify"]]
        self.drafter = self.mag
        self.load_aware = opts["plan"] == "load_aware"    # the planner sets ctx.planned_k in 0..k
        self.spec = DraftSpec("propose", (self.mag,))

    def roles(self) -> list[str]:
        return [self.target_name, DRAFTS]

    def step(self, ctx: StepContext):
        return speculative_step(ctx, self.spec, draft_length(ctx, self.k), self.verify)
