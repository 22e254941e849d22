"""Speculative cascades, lossy speculative sampling, and the cascades they are compared against.

* ``spec_cascade``   draft k tokens, score them in one target pass, verify with GenSpecSample against
  the cascade's target distribution pi = T(q, p) (Narasimhan et al., *Faster Cascades via Speculative Decoding*,
  Algorithm 5; token-specific rules from the later version of the same paper, section 5).
* ``lossy``          the same with pi = the lossy speculative sampling target (Narasimhan et al. 2024,
  Faster Cascades, Table 1).
* ``token_cascade``  the sequential token-level cascade TokenCascade[Chow] (Narasimhan et al. 2024, Faster Cascades,
  Algorithm 2): the drafter samples token by token; the target runs only when Chow's rule defers.
* ``oracle_cascade`` the oracle cascade (Narasimhan et al. 2024, Faster Cascades, Algorithm 3): both models at every
  position, the token drawn from pi directly (a quality reference; one target call per token).

None of them is lossless (``lossless = False``): each is tested to emit exactly its own pi.
Temperature / top-p follow Narasimhan et al., Faster Cascades (later version), appendix C: rules read the unscaled
distributions (softmax of the raw logits), the mixture / lossy target uses the scaled ones that are actually
sampled.
"""
from __future__ import annotations

import torch

from cluster.core.cascade_targets import (
    ALPHA_RANGE,
    RULES,
    cascade_target,
    defer_chow,
    deferral_rate,
    lossy_target,
)
from cluster.core.sampling import UNSCALED, logits_to_probs, sample
from cluster.core.verify import gen_spec_verify
from cluster.errors import ParamError
from cluster.strategies.base import (
    Option,
    Propose,
    Score,
    StepContext,
    Strategy,
    register,
)
from cluster.strategies.speculative import DRAFTER, K

ALPHA = Option("alpha", float, 0.1,
               "cascade cost parameter: rules defer less as alpha grows (1 = never defer, -2 = always); "
               "lossy takes [0, 1), 0 = lossless", low=ALPHA_RANGE[0], high=ALPHA_RANGE[1])
RULE = Option("rule", str, "opt", "deferral rule of the speculative cascade", choices=tuple(RULES))
MAX_RUN = 32   # token_cascade: most drafter tokens one step emits without a deferral


class _Cascade(Strategy):
    lossless = False

    def __init__(self, opts, models, target):
        super().__init__(opts, models, target)
        self.drafter = self.check_drafter(opts["drafter"] or self.drafter_names()[0])
        self.alpha = opts["alpha"]

    def roles(self) -> list[str]:
        return [self.target_name, self.drafter]


def gen_spec_step(ctx: StepContext, drafter_name: str, k: int, target_fn):
    """One draft-score-GenSpecSample step with pi = target_fn(q, p, q_raw, p_raw) (``[k, V]`` each).

    Drafts up to the whole remaining budget so every emitted token inside the budget sits at a draft
    position (distributed as pi); a bonus token from p past the budget is cut by the engine.
    """
    drafter, target = ctx.models[drafter_name], ctx.target
    draft, q_logits = yield Propose(drafter_name, k)               # [k], [k, V]
    ctx.stats.forward(drafter_name, len(draft))
    p_logits = yield Score(ctx.target_name, tuple(draft))          # [k+1, V]
    ctx.stats.forward(ctx.target_name, target=True)
    q, p = ctx.probs(q_logits), ctx.probs(p_logits)                # scaled: what is sampled
    pi = target_fn(q, p[:k], logits_to_probs(q_logits, UNSCALED), logits_to_probs(p_logits[:k], UNSCALED))
    verdict = gen_spec_verify(draft, q, pi, p[k], ctx.rng)
    ctx.stats.verification(len(draft), verdict.accepted)
    ctx.commit([target, drafter], verdict.accepted, [verdict.next_token])
    return draft[:verdict.accepted] + [verdict.next_token]


@register
class SpecCascade(_Cascade):
    name = "spec_cascade"
    help = "speculative cascade: GenSpecSample towards a deferral rule's mixture of drafter and target"
    options = (DRAFTER, K, RULE, ALPHA)

    def __init__(self, opts, models, target):
        super().__init__(opts, models, target)
        self.k, self.rule = opts["k"], opts["rule"]

    def step(self, ctx: StepContext):
        def fn(q, p, q_raw, p_raw):
            _record_deferrals(ctx, q, p, q_raw, p_raw, self.rule, self.alpha)
            return cascade_target(q, p, self.rule, self.alpha, q_raw, p_raw)
        return gen_spec_step(ctx, self.drafter, min(self.k, ctx.budget), fn)


def _record_deferrals(ctx: StepContext, q, p, q_raw, p_raw, rule: str, alpha: float) -> None:
    """Statistics only: how many of the ``[n, V]`` positions ``rule`` defers to the target."""
    q, p = q.to(torch.float64), p.to(torch.float64)
    deferred = deferral_rate(q_raw.to(torch.float64), p_raw.to(torch.float64), q, rule, alpha, p)
    ctx.stats.deferral(q.shape[0], float(deferred.sum()))


@register
class Lossy(_Cascade):
    name = "lossy"
    help = "lossy speculative sampling: accept w.p. min(1, p / ((1-alpha) q)), beta solved per position"
    options = (DRAFTER, K, ALPHA)

    def __init__(self, opts, models, target):
        super().__init__(opts, models, target)
        if not 0.0 <= self.alpha < 1.0:
            raise ParamError("alpha", "number in [0, 1) for strategy lossy", self.alpha)
        self.k = opts["k"]

    def step(self, ctx: StepContext):
        fn = lambda q, p, q_raw, p_raw: lossy_target(q, p, self.alpha)
        return gen_spec_step(ctx, self.drafter, min(self.k, ctx.budget), fn)


@register
class TokenCascade(_Cascade):
    name = "token_cascade"
    help = "sequential token cascade (Chow): drafter samples; the target runs only where max q < 1 - alpha"
    options = (DRAFTER, ALPHA)

    def step(self, ctx: StepContext):
        drafter, target = ctx.models[self.drafter], ctx.target
        kept: list[int] = []
        while len(kept) < min(ctx.budget, MAX_RUN):
            toks, q_logits = yield Propose(self.drafter, 1)                    # [1], [1, V]
            ctx.stats.forward(self.drafter, 1)
            defer = bool(defer_chow(logits_to_probs(q_logits[0], UNSCALED), None, self.alpha))
            ctx.stats.deferral(1, float(defer))
            if not defer:
                kept += toks                                                   # keep q's sample
                continue
            # defer: drop the drafter's token; one target pass over the kept run gives p here
            p = ctx.probs((yield Score(self.target_name, tuple(kept)))[-1])    # [V]
            ctx.stats.forward(self.target_name, target=True)
            tok = sample(p, ctx.rng)
            ctx.commit([target, drafter], len(kept), [tok])
            return kept + [tok]
        ctx.commit([target], 0, kept)              # the target catches up on its next call
        return kept


@register
class OracleCascade(_Cascade):
    name = "oracle_cascade"
    help = "oracle cascade reference: both models at every token, sample from the rule's mixture"
    options = (DRAFTER, RULE, ALPHA)

    def step(self, ctx: StepContext):
        drafter, target = ctx.models[self.drafter], ctx.target
        _, q_logits = yield Propose(self.drafter, 1)                           # [1, V]
        ctx.stats.forward(self.drafter, 1)
        p_logits = yield Score(self.target_name, ())                           # [1, V]
        ctx.stats.forward(self.target_name, target=True)
        q, p = ctx.probs(q_logits), ctx.probs(p_logits)
        q_raw, p_raw = logits_to_probs(q_logits, UNSCALED), logits_to_probs(p_logits, UNSCALED)
        _record_deferrals(ctx, q, p, q_raw, p_raw, self.opts["rule"], self.alpha)
        pi = cascade_target(q, p, self.opts["rule"], self.alpha, q_raw, p_raw)
        tok = sample(pi[0], ctx.rng)
        ctx.commit([target, drafter], 0, [tok])
        return [tok]
