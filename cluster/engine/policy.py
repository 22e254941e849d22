"""The speculation policy: the one place that decides, per request and engine step, whether the step drafts.

Before the strategies run, :meth:`SpeculationPolicy.plan` marks each running request's step plain
(``ctx.plain``: a target-only step, one token drawn from the target's law) or drafting (the strategy's own draft
length: its ``k``, capped by what the request may still emit).  A step is plain

* at a request's first step, for a lossless strategy without a predicted output (:meth:`starts_plain`): the
  first token is the target's prefill alone, so time to first token is plain decoding's (Leviathan et al., *Fast
  Inference from Transformers via Speculative Decoding*, Algorithm 1, make no demand on how the first token is
  drawn: any step that samples the target's law is exact).  A lossy strategy (whose first token follows its own
  rule) and a request with a predicted output (whose first block costs no drafter) draft from their first step;
* from ``plain_from_batch`` running requests up (:meth:`by_batch`: strategies with a fixed draft length --
  speculative, mag, cs_drafting, ``Strategy.plain_steps`` -- without a predicted output), as vLLM's
  ``speculative_disable_by_batch_size`` but decided per step: where the target is compute bound at that batch,
  a verification costs about what its tokens cost as plain steps, so drafting only adds work.  Below it they
  draft again.  This is the one knob that stops speculating; None never does.

The engine enacts the marks (:meth:`cluster.engine.engine.Engine._prefill`): a request's drafters that hold no state yet are
prefilled at the first step it drafts, and a plain step leaves them untouched (they catch up on the tokens they
missed when drafting resumes), so a request kept plain costs what plain decoding costs.  Whatever the marks,
the output law is the target's: a plain step samples it exactly and a drafting step is a lossless strategy's.

Not decided here, because it changes what a drafting step costs but never whether it drafts, how far, or its
law: where the draft side computes the block -- pre-drafted while the target verified the last one
(:attr:`cluster.core.draft.side.DraftSide.MAX_ROWS`), or by a far speculator
(:class:`cluster.core.draft.near_far.NearFarSide`'s ``max_rows`` and ``_worth``).
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.sequence import Sequence


@dataclass(frozen=True)
class SpeculationPolicy:
    """``plain_from_batch``: from this many running requests up, fixed-length drafting decodes plainly."""

    plain_from_batch: int | None = None

    def starts_plain(self, seq: Sequence) -> bool:
        """Whether ``seq``'s first step is the target's alone (its drafters are not prefilled on joining)."""
        return seq.req.strategy.lossless and not seq.req.prediction_ids

    def by_batch(self, seq: Sequence) -> bool:
        """Whether the batch size decides ``seq``'s steps (a fixed-length drafting request, no prediction)."""
        return self.plain_from_batch is not None and seq.req.strategy.plain_steps and not seq.req.prediction_ids

    def plain(self, seq: Sequence, batch: int) -> bool:
        """Whether ``seq``'s step in a batch of ``batch`` running requests is plain decoding."""
        if not seq.generated and self.starts_plain(seq):
            return True
        return self.by_batch(seq) and batch >= self.plain_from_batch

    def plan(self, running: list[Sequence]) -> None:
        """Mark this step of every request in ``running`` plain or drafting (``ctx.plain``)."""
        for seq in running:
            seq.ctx.plain = self.plain(seq, len(running))
