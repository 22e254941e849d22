"""Speculative sampling with one neural drafter (Leviathan et al. 2023; Chen et al. 2023).

Each step: the drafter proposes k tokens (k forward passes), the target scores them in one forward
pass, and a verifier from :data:`cluster.core.verifiers.VERIFIERS` keeps a prefix plus one more token.
"""
from __future__ import annotations

from cluster.core.verifiers import VERIFIERS
from cluster.strategies.base import (
    Option,
    Propose,
    Score,
    StepContext,
    Strategy,
    register,
)

DRAFTER = Option("drafter", str, None, "drafter model name (default: the config's first drafter)")
K = Option("k", int, 4, "draft tokens per step", low=1, high=64)
VERIFY = Option("verify", str, "token", "draft verifier", choices=lambda: tuple(VERIFIERS))
PLAN = Option("plan", str, "fixed", "draft length per step: fixed (= k) or load_aware (the engine's planner picks "
              "0..k from measured forward costs, batch size and acceptance)", choices=("fixed", "load_aware"))


@register
class Speculative(Strategy):
    name = "speculative"
    help = "draft k tokens with a neural drafter, verify them in one target pass"
    options = (DRAFTER, K, VERIFY, PLAN)

    def __init__(self, opts, models, target):
        super().__init__(opts, models, target)
        self.drafter = self.check_drafter(opts["drafter"] or self.drafter_names()[0])
        self.k = opts["k"]
        self.verify = VERIFIERS[opts["verify"]]
        self.load_aware = opts["plan"] == "load_aware"    # the planner sets ctx.planned_k in 0..k

    def roles(self) -> list[str]:
        return [self.target_name, self.drafter]

    def step(self, ctx: StepContext):
        return speculative_step(ctx, self.drafter, draft_length(ctx, self.k), self.verify)


def draft_length(ctx: StepContext, k: int) -> int:
    """The step's draft length: the planner's choice when it plans (0 = no speculation), else ``k``;
    never more than the tokens the request may still emit after the bonus token."""
    return min(k if ctx.planned_k is None else ctx.planned_k, ctx.budget - 1)


def speculative_step(ctx: StepContext, drafter_name: str, k: int, verify):
    """One draft-score-verify step; returns the emitted tokens (accepted + 1)."""
    drafter, target = ctx.models[drafter_name], ctx.target
    draft, q_logits = (yield Propose(drafter_name, k)) if k > 0 else ([], None)   # [k], [k, V]
    ctx.stats.forward(drafter_name, len(draft))
    p = ctx.probs((yield Score(ctx.target_name, tuple(draft))))                  # [k+1, V]
    ctx.stats.forward(ctx.target_name, target=True)
    q = ctx.probs(q_logits) if draft else p[:0]
    verdict = verify(draft, q, p, ctx.rng)
    new = draft[:verdict.accepted] + [verdict.next_token]
    if draft:
        ctx.stats.verification(len(draft), verdict.accepted)
    ctx.commit([target, drafter], verdict.accepted, [verdict.next_token])
    return new
