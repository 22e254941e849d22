"""Starting requests on their models, and the target-only first step.

A request's first token comes from the target's prefill alone: on joining, a lossless request is prefilled on
the target only, and its other models (the draft side, a drafter) are *stale* for it -- they hold no state yet.
A request with a stale model steps target-only (the engine's fallback, a plain autoregressive step: exactly the
target's law, so a lossless strategy keeps its output distribution, and greedy decoding its tokens), so its
first step samples the first token from the target's forward over the prompt, with no drafter's prefill or
draft before it.  At the start of the next step the stale models are prefilled with the committed tokens (prompt
+ first token, one batched call per model) and the strategy's own steps take over -- for a load-aware request
(``plan=load_aware``), at the first step its planner has it draft, so that plain decoding pays no drafter.
Time to first token is then the target's prefill, as for plain decoding, rather than the target's and every
drafter's prefill plus a drafted block and its verification (Leviathan et al., *Fast Inference from Transformers
via Speculative Decoding*, Algorithm 1, makes no demand on how the first token is drawn: any step that samples
the target's law is exact).  A lossy strategy (a speculative cascade, whose first token follows its own rule) and a request with a
predicted output (:mod:`cluster.core.prediction`: its first block costs no drafter) are prefilled everywhere and
draft from their first step.

The same path serves a model that went down and came back (:mod:`cluster.engine.health`): its requests' state
there is stale until the next step re-prefills it.
"""
from __future__ import annotations

import time

from cluster.core.calls import PrefillItem, prefill_scored
from cluster.engine.planner import is_planned
from cluster.engine.sequence import FINISHED, Sequence
from cluster.errors import ModelUnavailableError


def target_first(seq: Sequence) -> bool:
    """Whether ``seq``'s first step is the target's alone: a lossless strategy without a predicted output (a
    prediction's block is drafted at no drafter's cost and is worth most at the first step)."""
    return seq.req.strategy.lossless and not seq.req.prediction_ids


class Prefilling:
    """The prefill and fallback half of :class:`cluster.engine.engine.Engine` (its ``models``, ``target``,
    ``health``, ``scheduler``, ``_fallback``, ``_fail`` and ``model_down``)."""

    def _recover(self) -> None:
        """Probe the models that are down; prefill the stale models that answer (a drafter after a request's
        target-only first step, a model that is back) with their requests' committed tokens."""
        if self.health.down:
            self.health.refresh()
        back = {m for s in self.scheduler.running for m in s.stale} - self.health.down
        if back:
            self._prefill([s for s in self.scheduler.running if s.stale & back and not self._planned(s)], back)

    def _planned(self, seq: Sequence) -> bool:
        """Whether ``seq``'s stale models wait for the planner: a load-aware request's drafters are prefilled
        only at the first step the planner has it draft (:meth:`_prefill_drafting`), so a request the planner
        keeps on plain decoding costs what plain decoding costs -- no drafter prefill, no draft side; so are those
        of a request that :meth:`_plain_by_batch` may keep plain."""
        return self.planner is not None and (is_planned(seq) or self._by_batch(seq))

    def _by_batch(self, seq: Sequence) -> bool:
        """Whether ``engine.plain_from_batch`` decides ``seq``'s steps: a fixed-length drafting request without a
        predicted output (whose blocks cost no drafter)."""
        return self.plain_from_batch is not None and getattr(seq.req.strategy, "plain_steps", False) \
            and not is_planned(seq) and not seq.req.prediction_ids

    def _plain_by_batch(self, running: list[Sequence]) -> None:
        """``engine.plain_from_batch`` (vLLM's ``speculative_disable_by_batch_size``, per step): from that many
        running rows up, the requests of a drafting strategy with a fixed draft length (speculative, mag,
        cs_drafting: ``plain_steps``) step as plain decoding (``ctx.planned_k = 0``: a target-only step, the
        target's law exactly; the draft side is not called and catches up when drafting resumes), below it they
        draft again.  On a device where the target is compute bound at that batch, a verification costs about
        what its tokens cost as plain steps, so drafting only adds work (docs/operator-guide.md,
        "Batching").  Load-aware requests are left to the planner."""
        if self.plain_from_batch is None:
            return
        plain = len(running) >= self.plain_from_batch
        for s in running:
            if self._by_batch(s):
                s.ctx.planned_k = 0 if plain else None

    def stuck(self, seq: Sequence) -> bool:
        """Whether ``seq`` steps target-only whatever the planner says: its first step (the first token is the
        target's prefill alone), or one of its models is down."""
        return bool(seq.stale) and (not seq.generated or bool(seq.stale & self.health.down))

    def _prefill_drafting(self, running: list[Sequence]) -> None:
        """Prefill the stale models (the draft side) of the planned requests that draft this step, with their
        committed tokens, one batched call per model; one that fails stays stale and steps target-only."""
        drafting = [s for s in running if s.stale and self._planned(s) and not self.stuck(s)
                    and ((s.ctx.planned_k or 0) > 0 if is_planned(s) else s.ctx.planned_k != 0)]
        t0 = time.perf_counter()
        for name in dict.fromkeys(m for s in drafting for m in s.stale - self.health.down):
            self._prefill([s for s in drafting if name in s.stale], {name})
        planned = [s for s in drafting if is_planned(s)]
        if planned:
            self.planner.prefilled(planned, time.perf_counter() - t0)

    def _prefill(self, joined: list[Sequence], names: set[str] | None = None) -> None:
        """Start ``joined`` on their models (or on ``names`` only: stale models), one batched call each.  On
        joining (``names`` None) a lossless request starts on the target only (module docstring)."""
        for name in dict.fromkeys(r for s in joined for r in s.req.strategy.roles()):
            if names is not None and name not in names:
                continue
            items = [s for s in joined if name in s.req.strategy.roles() and s.status != FINISHED]
            later = items if name in self.health.down else [
                s for s in items if names is None and name != self.target and target_first(s)]
            for s in later:
                s.stale.add(name)
            items = [s for s in items if s not in later]
            if not items:
                continue
            scored = [s for s in items if name == self.target and s.wants_prompt_logprobs] if names is None else []
            try:
                self.models[name].prefill_batch([PrefillItem(s.rid, list(s.ctx.tokens), s.req.sampling, s.req.seed)
                                                 for s in items if s not in scored])
                if scored:          # the prompt's logprobs from the forward that fills the target's cache
                    rows = prefill_scored(self.models[name], [(s.rid, list(s.ctx.tokens), s.req.sampling,
                                                               s.req.seed) for s in scored])
                    for s, logits in zip(scored, rows):
                        s.set_prompt_logprobs(logits)
                for s in items:
                    s.stale.discard(name)
                    s.ctx.behind.pop(name, None)         # prefilled with every committed token
            except ModelUnavailableError as e:
                self.model_down(name, e)
                if name == self.target:                  # nothing can go on without it
                    for s in items:
                        self._fail(s, e)
            except Exception as e:                       # noqa: BLE001 - fails these requests only
                for s in items:
                    self._fail(s, e)

    def _step_of(self, seq: Sequence):
        """The request's strategy step, or a target-only step while one of its models is down or stale."""
        roles = set(seq.req.strategy.roles()) - {self.target}
        if roles & (self.health.down | seq.stale):
            return self._fallback.step(seq.ctx)
        return seq.req.strategy.step(seq.ctx)
