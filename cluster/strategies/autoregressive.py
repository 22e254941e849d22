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
    if ctx.batched_verify:                             # the round's rows sampled together on the target's device
        v = yield ctx.verify((), None)
        tok = v.next_token
        if ctx.logprobs is not None:
            ctx.step_logprobs = v.logprobs
    else:                                              # the per-row reference (engine.sampler: reference)
        logits = yield Score(ctx.target_name, ())          # [1, V]
        tok = sample(ctx.target_probs(logits)[0], ctx.rng)
        ctx.record_logprobs(logits, [tok])
    ctx.stats.forward(ctx.target_name, target=True)
    ctx.commit([ctx.target], 0, [tok])
    return [tok]
