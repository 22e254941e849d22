"""Speculative cascades, lossy speculative sampling, and the cascades they are compared against.

* ``spec_cascade``   draft k tokens, score them in one target pass, verify with GenSpecSample against
  the cascade's target distribution pi = T(q, p) (Narasimhan et al., *Faster Cascades via Speculative Decoding*,
  Algorithm 5; token-specific rules from the later version of the same paper, section 5).
* ``lossy``          the same with pi = the lossy speculative sampling target (Narasimhan et al. 2024,
  Faster Cascades, Table 1), beta solved per position (``beta=solve``, Tran-Thien 2023) or fixed
  (``beta=1``: the paper's heuristic and main lossy baseline, section 2 and 6).
* ``token_cascade``  the sequential token-level cascade TokenCascade[Chow] (Narasimhan et al. 2024, Faster Cascades,
  Algorithm 2): the drafter samples token by token; the target runs only when Chow's rule defers.
* ``oracle_cascade`` the oracle cascade (Narasimhan et al. 2024, Faster Cascades, Algorithm 3): both models at every
  position, the token drawn from pi directly (a quality reference; one target call per token).

Option ``bonus`` (``spec_cascade``, ``lossy``): where the whole draft is accepted, the bonus token is drawn
from p at position t+gamma (``bonus=p``, the first version of Narasimhan et al., Algorithm 4, and the
default: no extra forward pass) or from pi_{t+gamma} = T(q_{t+gamma}, p_{t+gamma}) (``bonus=pi``, the later
version's Algorithm 4: one more drafter forward for q_{t+gamma}; then every emitted token follows pi).

None of them is lossless (``lossless = False``): each is tested to emit exactly its own pi.  The logprobs
they report (requests with ``logprobs``) are the target's raw ones at each emitted position, not pi's: the
distribution a token was drawn from differs from the one reported.  ``token_cascade`` runs the target only
where it defers, so a run that never deferred costs one more target pass, for those requests only.
Temperature / top-p follow Narasimhan et al., Faster Cascades (later version), appendix C: rules read the unscaled
distributions (softmax of the raw logits), the mixture / lossy target uses the scaled ones that are actually
sampled.
"""
from __future__ import annotations

import torch

from cluster.core.cascade_targets import (
    ALPHA_RANGE,
    BETA_SOLVE,
    RULES,
    cascade_target,
    check_beta,
    defer_chow,
    deferral_rate,
    lossy_target,
)
from cluster.core.draft.programs import DraftBlock
from cluster.core.sampling import UNSCALED, logits_to_probs, sample
from cluster.core.verify import gen_spec_prefix
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
BONUS = Option("bonus", str, "p", "bonus token after a fully accepted draft: from p (first version of Narasimhan "
               "et al., Algorithm 4) or pi (later version; one more drafter forward)", choices=("p", "pi"))


def parse_beta(value):
    """``solve`` or a number in (0, 1] (the strategy checks beta >= 1 - alpha)."""
    if isinstance(value, str) and value.strip() == BETA_SOLVE:
        return BETA_SOLVE
    try:
        beta = float(value)
    except (TypeError, ValueError):
        beta = None
    if beta is None or isinstance(value, bool) or not 0.0 < beta <= 1.0:
        raise ParamError("beta", f"'{BETA_SOLVE}' or a number in [1 - alpha, 1]", value)
    return beta


BETA = Option("beta", str, BETA_SOLVE, "lossy: beta solved per position (solve, Tran-Thien) or fixed in "
              "[1 - alpha, 1] (1: the paper's heuristic)", parser=parse_beta)
MAX_RUN = 32   # token_cascade: most drafter tokens one step emits without a deferral


class _Cascade(Strategy):
    lossless = False

    def __init__(self, opts, models, target):
        super().__init__(opts, models, target)
        self.drafter = self.check_drafter(opts["drafter"] or self.drafter_names()[0])
        self.alpha = opts["alpha"]

    def roles(self) -> list[str]:
        return [self.target_name, self.drafter]


def gen_spec_step(ctx: StepContext, drafter_name: str, k: int, target_fn, bonus: str = "p", law: tuple = ()):
    """One draft-score-GenSpecSample step with pi = target_fn(q, p, q_raw, p_raw) (``[n, V]`` each).

    Drafts up to the whole remaining budget.  A fully accepted draft gets a bonus token from p[k]
    (``bonus="p"``) or from pi at position k+1 (``bonus="pi"``, from one more drafter forward for q there);
    none when the draft already fills the budget (it would be cut).  Through the batched sampler (``law``:
    pi's name and parameters, :class:`cluster.core.verify_round.VerifyItem`) pi is built on the target's
    device and the bonus-pi forward is drafted with the block (one drafter call); the per-row reference
    (``engine.sampler: reference``) calls ``target_fn`` on the host.
    """
    if ctx.batched_verify:
        return (yield from _gen_spec_batched(ctx, drafter_name, k, bonus, law))
    drafter, target = ctx.models[drafter_name], ctx.target
    draft, q_logits = yield Propose(drafter_name, k)               # [k], [k, V]
    ctx.stats.forward(drafter_name, len(draft))
    p_logits = yield Score(ctx.target_name, tuple(draft))          # [k+1, V]
    ctx.stats.forward(ctx.target_name, target=True)
    k = len(draft)
    q, p = ctx.probs(q_logits), ctx.probs(p_logits)                # scaled: what is sampled
    pi = target_fn(q, p[:k], logits_to_probs(q_logits, UNSCALED), logits_to_probs(p_logits[:k], UNSCALED))
    verdict = gen_spec_prefix(draft, q, pi, ctx.rng)
    accepted = k if verdict is None else verdict.accepted
    ctx.stats.verification(k, accepted)
    if verdict is not None:
        new = [verdict.next_token]
    elif k >= ctx.budget:
        new = []
    elif bonus == "pi":
        q_next = yield Score(drafter_name, ())                      # [1, V]: q(. | x_{<t+gamma})
        ctx.stats.forward(drafter_name, 1)
        pi_next = target_fn(ctx.probs(q_next), p[k:], logits_to_probs(q_next, UNSCALED),
                            logits_to_probs(p_logits[k:], UNSCALED))
        new = [sample(pi_next[0], ctx.rng)]
    else:
        new = [sample(p[k], ctx.rng)]
    ctx.commit([target, drafter], accepted, new)
    emitted = draft[:accepted] + new
    ctx.record_logprobs(p_logits, emitted)       # the target's numbers, not pi's (lossy: see the module)
    return emitted


def _gen_spec_batched(ctx: StepContext, drafter_name: str, k: int, bonus: str, law: tuple):
    extra = int(bonus == "pi" and k < ctx.budget)                 # q_{t+gamma} drafted with the block
    draft, q_logits = yield Propose(drafter_name, k + extra)       # [k (+1)], [k (+1), V]
    ctx.stats.forward(drafter_name, len(draft))
    extra = min(extra, max(len(draft) - k, 0))
    draft = draft[:len(draft) - extra]
    v = yield ctx.verify(draft, DraftBlock(draft, "logits", q_logits), "token",
                         law + ("pi" if extra else "p",))
    ctx.stats.forward(ctx.target_name, target=True)
    ctx.stats.verification(len(draft), v.accepted)
    if law[0] == "cascade":
        ctx.stats.deferral(len(draft) + int(bool(extra) and v.bonus), v.deferred)
    new = [] if v.bonus and len(draft) >= ctx.budget else [v.next_token]
    ctx.commit([ctx.target, ctx.models[drafter_name]], v.accepted, new)
    emitted = draft[:v.accepted] + new
    if ctx.logprobs is not None:                 # the target's numbers, not pi's (lossy: see the module)
        ctx.step_logprobs = v.logprobs[:len(emitted)]
    return emitted


@register
class SpecCascade(_Cascade):
    name = "spec_cascade"
    help = "speculative cascade: GenSpecSample towards a deferral rule's mixture of drafter and target"
    options = (DRAFTER, K, RULE, ALPHA, BONUS)

    def __init__(self, opts, models, target):
        super().__init__(opts, models, target)
        self.k, self.rule = opts["k"], opts["rule"]

    def step(self, ctx: StepContext):
        def fn(q, p, q_raw, p_raw):
            _record_deferrals(ctx, q, p, q_raw, p_raw, self.rule, self.alpha)
            return cascade_target(q, p, self.rule, self.alpha, q_raw, p_raw)
        return gen_spec_step(ctx, self.drafter, min(self.k, ctx.budget), fn, self.opts["bonus"],
                             ("cascade", self.rule, self.alpha))


def _record_deferrals(ctx: StepContext, q, p, q_raw, p_raw, rule: str, alpha: float) -> None:
    """Statistics only: how many of the ``[n, V]`` positions ``rule`` defers to the target."""
    q, p = q.to(torch.float64), p.to(torch.float64)
    deferred = deferral_rate(q_raw.to(torch.float64), p_raw.to(torch.float64), q, rule, alpha, p)
    ctx.stats.deferral(q.shape[0], float(deferred.sum()))


@register
class Lossy(_Cascade):
    name = "lossy"
    help = "lossy speculative sampling: accept w.p. min(1, p / ((1-alpha) q)), beta solved per position or fixed"
    options = (DRAFTER, K, ALPHA, BETA, BONUS)

    def __init__(self, opts, models, target):
        super().__init__(opts, models, target)
        if not 0.0 <= self.alpha < 1.0:
            raise ParamError("alpha", "number in [0, 1) for strategy lossy", self.alpha)
        self.k = opts["k"]
        self.beta = opts["beta"] if opts["beta"] == BETA_SOLVE else check_beta(opts["beta"], self.alpha)

    def step(self, ctx: StepContext):
        fn = lambda q, p, q_raw, p_raw: lossy_target(q, p, self.alpha, self.beta)
        return gen_spec_step(ctx, self.drafter, min(self.k, ctx.budget), fn, self.opts["bonus"],
                             ("lossy", self.alpha, self.beta))


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
            if ctx.batched_verify:                 # the run kept as it is, the token drawn on the device
                v = yield ctx.verify(kept, None, "accept")
                tok = v.next_token
                ctx.step_logprobs = v.logprobs
            else:
                p_logits = yield Score(self.target_name, tuple(kept))          # [len(kept)+1, V]
                tok = sample(ctx.probs(p_logits[-1]), ctx.rng)
                ctx.record_logprobs(p_logits, kept + [tok])
            ctx.stats.forward(self.target_name, target=True)
            ctx.commit([target, drafter], len(kept), [tok])
            return kept + [tok]
        if ctx.logprobs is None:
            ctx.commit([target], 0, kept)          # the target catches up on its next call
        else:                                      # the target's logprobs cost it one pass over the run
            p_logits = yield Score(self.target_name, tuple(kept))              # [len(kept)+1, V]
            ctx.stats.forward(self.target_name, target=True)
            ctx.commit([target], len(kept), [])
            ctx.record_logprobs(p_logits, kept)
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
        if ctx.batched_verify:             # pi_1 = T(q_1, p_1) as a bonus law after an empty draft, on the device
            v = yield ctx.verify((), DraftBlock([], "logits", q_logits), "token",
                                 ("cascade", self.opts["rule"], self.alpha, "pi"))
            ctx.stats.forward(self.target_name, target=True)
            ctx.stats.deferral(1, v.deferred)
            ctx.commit([target, drafter], 0, [v.next_token])
            ctx.step_logprobs = v.logprobs
            return [v.next_token]
        p_logits = yield Score(self.target_name, ())                           # [1, V]
        ctx.stats.forward(self.target_name, target=True)
        q, p = ctx.probs(q_logits), ctx.probs(p_logits)
        q_raw, p_raw = logits_to_probs(q_logits, UNSCALED), logits_to_probs(p_logits, UNSCALED)
        _record_deferrals(ctx, q, p, q_raw, p_raw, self.opts["rule"], self.alpha)
        pi = cascade_target(q, p, self.opts["rule"], self.alpha, q_raw, p_raw)
        tok = sample(pi[0], ctx.rng)
        ctx.commit([target, drafter], 0, [tok])
        ctx.record_logprobs(p_logits, [tok])
        return [tok]
