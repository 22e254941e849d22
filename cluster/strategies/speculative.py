"""Speculative sampling with one neural drafter (Leviathan et al. 2023; Chen et al. 2023).

Each step: the draft side drafts a block (here: the drafter proposes k tokens, k forward passes), the
target scores it in one forward pass, and a verifier from :data:`cluster.core.verifiers.VERIFIERS` keeps a
prefix plus one more token.  :func:`speculative_step` is that step for every strategy that drafts through
the draft side (speculative, mag, specdec_pp, cs_drafting): only the :class:`DraftSpec` differs.
"""
from __future__ import annotations

import torch

from cluster.core.draft.programs import DRAFTS, DraftBlock, DraftSpec
from cluster.core.verifiers import VERIFIERS
from cluster.strategies.autoregressive import plain_step
from cluster.strategies.base import (
    Draft,
    Option,
    Score,
    StepContext,
    Strategy,
    register,
)

DRAFTER = Option("drafter", str, None, "drafter model name (default: the config's first drafter)")
K = Option("k", int, 4, "draft tokens per step", low=1, high=64)
VERIFY = Option("verify", str, "token", "draft verifier", choices=lambda: tuple(VERIFIERS))


@register
class Speculative(Strategy):
    name = "speculative"
    help = "draft k tokens with a neural drafter, verify them in one target pass"
    options = (DRAFTER, K, VERIFY)
    constrained = True
    plain_steps = True             # ctx.plain: a plain step (draft_length)

    def __init__(self, opts, models, target):
        super().__init__(opts, models, target)
        self.drafter = self.choose_drafter(opts)
        self.k = opts["k"]
        self.verify = VERIFIERS[opts["verify"]]
        self.spec = DraftSpec("propose", (self.drafter,))

    def choose_drafter(self, opts) -> str:
        """The drafter option, else the config's first drafter (a strategy that is this one with another
        drafter says which here)."""
        return self.check_drafter(opts["drafter"] or self.drafter_names()[0])

    def roles(self) -> list[str]:
        return [self.target_name, DRAFTS]

    def step(self, ctx: StepContext):
        return speculative_step(ctx, self.spec, draft_length(ctx, self.k), self.verify)


def draft_length(ctx: StepContext, k: int) -> int:
    """The step's draft length: 0 (plain decoding) where the engine's speculation policy says so
    (:mod:`cluster.engine.policy`), else ``k``, never more than the tokens the request may still emit after the
    bonus token."""
    return 0 if ctx.plain else min(k, ctx.budget - 1)


def speculative_step(ctx: StepContext, spec: DraftSpec, k: int, verify):
    """One draft-score-verify step: a block of at most ``k`` drafts from the draft side (one call), one
    target forward over it, the verifier's verdict; returns the emitted tokens (accepted + 1).

    With a predicted output (:mod:`cluster.core.prediction`) the block is the draft side's extended by the
    prediction's continuation where the draft agrees with the prediction, or, while the output is in step with
    the prediction, the prediction's continuation alone (the draft side is not asked that step); the
    prediction's tokens are deterministic drafts (one-hot q), within the budget.

    ``k = 0`` (the policy's plain decoding, a last step with room for one token) is an autoregressive step,
    :func:`cluster.strategies.autoregressive.plain_step`, and costs what one costs: the draft side is neither
    called nor told the token (``ctx.skip``); the next step that drafts first sends it the tokens it missed, in
    one bookkeeping call (``ctx.catch_up``), and its drafters feed them with their first forward."""
    if k == 0:
        ctx.skip(DRAFTS)
        return (yield from plain_step(ctx))
    ctx.catch_up(DRAFTS)
    pred = ctx.prediction
    lead = pred.lead(ctx.tokens, ctx.budget - 1) if pred is not None else []
    if lead:
        block = DraftBlock(lead)                                                       # one-hot q
    else:
        block = yield Draft(DRAFTS, spec, k, ctx.budget)                                # tokens [L], q [L, V]
    own = 0 if lead else len(block.tokens)                                            # the draft side's tokens
    more = pred.follow(ctx.tokens, block.tokens, ctx.budget - 1 - own) if pred is not None and not lead else []
    for name, n in block.forwards.items():
        ctx.stats.forward(name, n)
    draft = block.tokens + more
    if ctx.batched_verify:                     # the round's rows verified together on the target's device
        v = yield ctx.verify(draft, with_prediction(block, more, ctx), verify_method(verify))
        accepted, next_token = v.accepted, v.next_token
        if ctx.logprobs is not None:
            ctx.step_logprobs = v.logprobs
    else:                                      # the per-row reference (engine.sampler: reference)
        p_logits = yield Score(ctx.target_name, tuple(draft))                          # [L+1, V]
        p = ctx.target_probs(p_logits, draft)                                         # masked by a grammar
        q = block.probs(p.shape[-1], ctx.sampling) if block.tokens else p[:0]         # [L, V]
        if more:                               # the prediction's continuation: deterministic, one-hot rows
            q = torch.cat([q, torch.nn.functional.one_hot(torch.tensor(more), p.shape[-1]).to(q.dtype)])
        verdict = verify(draft, q, p, ctx.rng)
        accepted, next_token = verdict.accepted, verdict.next_token
        ctx.record_logprobs(p_logits, draft[:accepted] + [next_token])
    ctx.stats.forward(ctx.target_name, target=True)
    if draft:
        ctx.stats.verification(len(draft), accepted)
    emitted = draft[:accepted] + [next_token]
    if len(draft) > own:                                             # the prediction drafted positions own..
        ctx.stats.prediction(len(draft) - own, max(0, accepted - own))
        pred.verified(len(draft) - own, max(0, accepted - own))
    kept = min(accepted, own)              # the draft side holds only its own block: the rest is told to it
    ctx.commit([ctx.target], accepted, [next_token])
    ctx.commit([ctx.models[DRAFTS]], kept, emitted[kept:])
    return emitted


def verify_method(verify) -> str:
    """The batched sampler's name for a verifier of :data:`cluster.core.verifiers.VERIFIERS`."""
    return next(name for name, fn in VERIFIERS.items() if fn is verify)


def with_prediction(block: DraftBlock, more: list[int], ctx: StepContext) -> DraftBlock:
    """The q of ``block.tokens + more``: a prediction's tokens are deterministic (one-hot rows), so a block
    drawn from a neural drafter travels as dense rows with the one-hot rows after them."""
    if not more or block.form == "onehot" or not block.tokens:
        return block if block.tokens or not more else DraftBlock(list(more))
    V = ctx.target.vocab_size
    q = torch.cat([block.probs(V, ctx.sampling),
                   torch.nn.functional.one_hot(torch.tensor(more), V).to(torch.float64)])
    return DraftBlock(block.tokens + more, "dense", q)
