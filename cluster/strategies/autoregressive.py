"""Plain autoregressive decoding with the target: the baseline every strategy is measured against."""
from __future__ import annotations

from cluster.core.sampling import sample
from cluster.strategies.base import Score, StepContext, Strategy, register


@register
class Autoregressive(Strategy):
    name = "autoregressive"
    help = "one target forward pass per token"
    constrained = True

    def roles(self) -> list[str]:
        return [self.target_name]

    def step(self, ctx: StepContext):
        return plain_step(ctx)


def plain_step(ctx: StepContext):
    """One target forward over the pending token and one token sampled from the target's law: the whole of an
    autoregressive step, and of every drafting strategy's step of draft length 0 (speculative.py)."""
    logits = yield Score(ctx.target_name, ())          # [1, V]
    ctx.stats.forward(ctx.target_name, target=True)
    tok = sample(ctx.target_probs(logits)[0], ctx.rng)
    ctx.commit([ctx.target], 0, [tok])
    ctx.record_logprobs(logits, [tok])
    return [tok]
