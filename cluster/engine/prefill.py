"""Starting requests on their models, and the target-only steps of a request whose drafters hold no state.

A request's models that hold no state for it are *stale* (``Sequence.stale``): on joining, a request whose first
step the speculation policy makes plain (:meth:`cluster.engine.policy.SpeculationPolicy.starts_plain`) is prefilled
on the target only; a model that went down and came back (:mod:`cluster.engine.health`) lost its requests'
state.  A request with a stale model steps target-only (the engine's fallback, a plain autoregressive step:
exactly the target's law, so a lossless strategy keeps its output distribution, and greedy decoding its tokens).
At the first step the policy has it draft, its stale models that answer are prefilled with the committed tokens
(prompt and every token so far, one batched call per model) and the strategy's own steps take over; while the
policy keeps it plain they stay stale, so plain decoding pays no drafter.
"""
from __future__ import annotations

from cluster.core.calls import PrefillItem, prefill_scored
from cluster.engine.sequence import FINISHED, Sequence
from cluster.errors import ModelUnavailableError


class Prefilling:
    """The prefill and fallback half of :class:`cluster.engine.engine.Engine` (its ``models``, ``target``,
    ``health``, ``policy``, ``_fallback``, ``_fail`` and ``model_down``)."""

    def _prefill_drafting(self, running: list[Sequence]) -> None:
        """Prefill the stale models that answer of the requests that draft this step (``ctx.plain`` False), with
        their committed tokens, one batched call per model; one that fails stays stale and steps target-only."""
        drafting = [s for s in running if s.stale - self.health.down and not s.ctx.plain]
        for name in dict.fromkeys(m for s in drafting for m in s.stale - self.health.down):
            self._prefill([s for s in drafting if name in s.stale], {name})

    def _prefill(self, joined: list[Sequence], names: set[str] | None = None) -> None:
        """Start ``joined`` on their models (or on ``names`` only: stale models), one batched call each.  On
        joining (``names`` None) a request whose first step is plain starts on the target only."""
        for name in dict.fromkeys(r for s in joined for r in s.req.strategy.roles()):
            if names is not None and name not in names:
                continue
            items = [s for s in joined if name in s.req.strategy.roles() and s.status != FINISHED]
            later = items if name in self.health.down else [
                s for s in items if names is None and name != self.target and self.policy.starts_plain(s)]
            for s in later:
                s.stale.add(name)
            items = [s for s in items if s not in later]
            if not items:
                continue
            scored = [s for s in items if name == self.target and s.wants_prompt_logprobs] if names is None else []
            try:
                plain = [s for s in items if s not in scored]
                hits = self.models[name].prefill_batch([PrefillItem(s.rid, list(s.ctx.tokens), s.req.sampling,
                                                                    s.req.seed) for s in plain])
                if name == self.target and names is None and hits:     # the prefix cache's hits (usage)
                    for s, hit in zip(plain, hits):
                        s.ctx.stats.cached_tokens = int(hit)
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
