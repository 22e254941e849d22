"""The engine: requests in, tokens out, many requests per forward pass (continuous batching).

Three roles, as in nano-vllm: admission (:mod:`cluster.engine.validate`: a request becomes one
:class:`PreparedRequest`), the :class:`Scheduler` (who runs; no torch), and the model handles (who own
the device).  :meth:`Engine.step` glues them: requests join between steps (their prompts prefilled in
one batched call per model, the target's first: :meth:`Engine._prefill`), every running request's
strategy step advances together -- their model calls grouped per model into one batched call per round
(:mod:`cluster.engine.rounds`) -- and each request's tokens go through its stop rules and out as a
:class:`StreamChunk`.  A batch of one is just a case of it; in-process (CLI, tests, benchmarks) and the
cluster (over remote handles) run this same loop.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator

from cluster.core.calls import PrefillItem, prefill_scored
from cluster.core.interfaces import BatchedHandle, Tokenizer
from cluster.core.model_set import ModelSet
from cluster.core.prediction import Prediction
from cluster.core.sampling import Rng
from cluster.core.stats import RequestStats
from cluster.engine.health import ModelHealth
from cluster.engine.kv_budget import derive_kv_budget
from cluster.engine.policy import SpeculationPolicy
from cluster.engine.request import GenerationRequest, GenerationResult, PreparedRequest, StreamChunk
from cluster.engine.rounds import run_rounds
from cluster.engine.scheduler import Limits, Scheduler
from cluster.engine.sequence import FINISHED, Sequence
from cluster.engine.stop import StopDecoder
from cluster.engine.validate import prepare
from cluster.errors import DeadlineExceededError, ModelUnavailableError, ParamError, check_choice
from cluster.strategies import REGISTRY, StepContext

log = logging.getLogger("specserve.engine")
SAMPLERS = ("batched", "reference")


class Engine:
    """Runs any registered strategy, for many requests at once, over a set of model handles.

    ``models`` is the finished :class:`ModelSet` a composition root built (target, drafters, draft side; the
    engine builds none of it); ``defaults`` holds default strategy options (from the config),
    ``max_new_tokens_limit`` the server-side cap, ``limits`` the batch and queue sizes and KV budget;
    ``policy`` decides which steps draft (:mod:`cluster.engine.policy`).
    """

    def __init__(self, models: ModelSet, tokenizer: Tokenizer, *, default_strategy: str = "speculative",
                 defaults: dict[str, Any] | None = None, max_new_tokens_limit: int = 1024, rng_factory=Rng,
                 limits: Limits = Limits(), policy: SpeculationPolicy = SpeculationPolicy(),
                 request_timeout_s: float | None = None, sampler: str = "batched", resume_limit: int = 0):
        self.models: dict[str, BatchedHandle] = dict(models.handles)
        self.tokenizer, self.target = tokenizer, models.target
        self.default_strategy = default_strategy
        self.defaults = dict(defaults or {})
        self.max_new_tokens_limit = max_new_tokens_limit
        self.rng_factory = rng_factory      # seed -> Rng; the exact-enumeration tests swap it
        self.sampler = check_choice("sampler", sampler, SAMPLERS)   # batched on the device, or the per-row reference
        self.vocab_size = min(m.vocab_size for m in self.models.values())
        self.scheduler = Scheduler(limits)
        self.policy = policy
        self.request_timeout_s = request_timeout_s   # server-side deadline of every request (None: none)
        self.resume_limit = resume_limit    # times a request whose target state was lost starts again (_suspend)
        self.health = ModelHealth(self.models)
        self._fallback = REGISTRY["autoregressive"]({}, self.models, self.target)   # target-only steps
        self._lock = threading.RLock()      # add/abort may come from other threads than step()
        self._live: dict[str, Sequence] = {}
        self._aborted: set[str] = set()
        self._ended: list[Sequence] = []    # ended this step: still live until the step's flush released them
        self.steps = self.step_rows = 0     # engine steps run, and requests advanced over them (mean batch)

    @classmethod
    def configured(cls, models: ModelSet, tokenizer: Tokenizer, spec) -> "Engine":
        """An engine from a config's ``engine:`` section (read by attribute; both runtimes use this).  Without
        ``kv_budget_tokens`` the budget is derived from the models' memory reports (:mod:`cluster.engine.kv_budget`)."""
        budget = spec.kv_budget_tokens or derive_kv_budget(
            dict(models.handles), fraction=getattr(spec, "kv_memory_fraction", 0.9),
            memory_gib=getattr(spec, "device_memory_gib", None))
        return cls(models, tokenizer, default_strategy=spec.strategy, defaults=spec.options,
                   max_new_tokens_limit=spec.max_new_tokens_limit,
                   limits=Limits(spec.max_batch, spec.max_queue, budget),
                   policy=SpeculationPolicy(getattr(spec, "plain_from_batch", None)),
                   request_timeout_s=spec.request_timeout_s, sampler=getattr(spec, "sampler", "batched"),
                   resume_limit=getattr(spec, "resume_limit", 0))

    # -- admission ----------------------------------------------------------------------------------
    def prepare(self, req: GenerationRequest | PreparedRequest) -> PreparedRequest:
        """Validate and tokenize ``req`` once (raises ParamError); a prepared request passes through."""
        if isinstance(req, PreparedRequest):
            return req
        return prepare(req, self.models, self.tokenizer, self.target, default_strategy=self.default_strategy,
                       defaults=self.defaults, max_new_tokens_limit=self.max_new_tokens_limit,
                       vocab_size=self.vocab_size)

    def add(self, req: GenerationRequest | PreparedRequest, sink: Callable[[StreamChunk], None] | None = None,
            on_end: Callable[[Sequence], None] | None = None) -> Sequence:
        """Queue a request (it joins the batch at the next step); raises ParamError / OverloadedError.
        ``sink`` gets its chunks; ``on_end`` is called once the request has left, whatever the outcome (at
        the end of the step, once its state is released on every model)."""
        req = self.prepare(req)
        stats = RequestStats(strategy=req.strategy_name, prompt_tokens=len(req.prompt_ids))
        eos = None if req.ignore_eos else self.tokenizer.eos_token_id
        ctx = StepContext(req.rid, self.models, self.target, req.sampling, self.rng_factory(req.seed), stats,
                          list(req.prompt_ids), 0, eos=eos, logprobs=req.logprobs,
                          prediction=Prediction(req.prediction_ids, len(req.prompt_ids)) if req.prediction_ids else None,
                          batched=self.sampler == "batched")
        seq = Sequence(req, ctx, StopDecoder(self.tokenizer, req.stop), eos, sink, on_end)
        if req.resumed:                  # a continuation: what an earlier run of it emitted is committed
            seq.resume_from(req.resumed)
        if self.request_timeout_s is not None:
            seq.deadline = seq.t0 + self.request_timeout_s
        if self.target in self.health.down and not self.health.refresh() & {self.target}:
            raise ModelUnavailableError(self.target)
        with self._lock:
            if req.rid in self._live:
                raise ParamError("request_id", "an id not used by a live request", req.rid)
            self.scheduler.add(seq)
            self._live[req.rid] = seq
        return seq

    def abort(self, rid: str) -> bool:
        """Stop request ``rid`` at the next step boundary and free its state; False if it is not live."""
        with self._lock:
            if rid not in self._live:
                return False
            self._aborted.add(rid)
            return True

    @property
    def has_work(self) -> bool:
        return bool(self._live)

    def live(self) -> list[Sequence]:
        with self._lock:
            return list(self._live.values())

    # -- the step -----------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One engine step for every running request; returns the requests that ended in it.  Schedule (who
        stops, who joins and is prefilled), run every running request's strategy step with one batched call per
        model and round, postprocess (stop rules, chunks), release what ended."""
        if self.health.down:             # probe: a model that is back is prefilled for the requests that draft
            self.health.refresh()
        ended, joined = self._schedule(time.perf_counter())
        if joined:
            self._prefill(joined)
        running = self._runnable(ended)
        self._begin(running)
        ended += self._postprocess(run_rounds(running, self.models, self.target, self._step_of, self.model_down))
        self._release()
        return ended

    def _schedule(self, now: float) -> tuple[list[Sequence], list[Sequence]]:
        """End the cancelled and the expired requests; -> (those, the requests that join the batch now)."""
        with self._lock:
            ended = [self._live[rid] for rid in self._aborted if rid in self._live]
            self._aborted.clear()
            for seq in ended:
                seq.finish = "cancelled"
                self._end(seq)
            for seq in [s for s in self._live.values() if s.expired(now)]:
                self._fail(seq, DeadlineExceededError(f"request {seq.rid} ran past its deadline of "
                                                      f"{self.request_timeout_s:g}s"), finish="deadline")
                ended.append(seq)
            # while the target is down nobody joins: the requests it lost wait for it, at the head of the queue
            return ended, [] if self.target_down else self.scheduler.schedule()

    @property
    def target_down(self) -> bool:
        """The target does not answer: no step can run (the step loop waits for the health watchdog)."""
        return self.target in self.health.down

    def _runnable(self, ended: list[Sequence]) -> list[Sequence]:
        """The running requests that step now; a request for prompt logprobs only is done once prefilled
        (an empty generation, finish "length") and joins ``ended``."""
        running = [s for s in self.scheduler.running if s.status != FINISHED]
        for seq in [s for s in running if not s.req.max_new_tokens]:
            running.remove(seq)
            seq.emit(seq.accept([]))
            self._end(seq)
            ended.append(seq)
        return running

    def _begin(self, running: list[Sequence]) -> None:
        """Count the step, open each request's step, let the policy mark which steps draft, and prefill the
        stale models of those that do."""
        if not running:
            return
        self.steps += 1
        self.step_rows += len(running)
        for seq in running:
            seq.begin_step()
        self.policy.plan(running)
        self._prefill_drafting(running)

    def _postprocess(self, outs: dict[Sequence, Any]) -> list[Sequence]:
        """Each request's step result through its stop rules and out as a chunk; -> the requests that ended."""
        ended = []
        for seq, out in outs.items():
            if not isinstance(out, BaseException):
                out = seq.check_logprobs(out)
            if isinstance(out, BaseException):
                if self._resumable(seq, out):
                    self._suspend(seq)
                    continue
                self._fail(seq, out)
                ended.append(seq)
                continue
            seq.emit(seq.accept(out))
            if seq.finish is not None:
                self._end(seq)
                ended.append(seq)
        return ended

    def _release(self) -> None:
        """Send each model's queued bookkeeping (releases of ended requests among it; remote handles queue it):
        outside the engine lock, so one hung actor cannot stall admission.  Requests whose state is released
        everywhere now leave, and are told so."""
        for name, h in self.models.items():
            try:
                h.flush()
            except Exception as e:                       # noqa: BLE001 - a dead model must not stop the loop
                if isinstance(e, ModelUnavailableError):
                    self.model_down(name, e)
                log.warning("flushing %s failed: %s", name, e)
        done, self._ended = self._ended, []
        for seq in done:
            with self._lock:
                self._live.pop(seq.rid, None)
            if seq.on_end is not None:
                seq.on_end(seq)

    def model_down(self, name: str, error: BaseException) -> None:
        """Mark ``name`` down (also from a health watchdog's thread): every live request's state there is
        lost; requests go on without a drafter, and fail at their next target call without the target."""
        self.health.mark_down(name, error)
        for s in self.live():
            if name in s.req.strategy.roles():
                s.stale.add(name)

    def _resumable(self, seq: Sequence, error: BaseException) -> bool:
        return isinstance(error, ModelUnavailableError) and self.target_down and seq.resumes < self.resume_limit

    def _suspend(self, seq: Sequence) -> None:
        """The target lost ``seq``'s state (its actor died or was replaced): release the request everywhere and
        queue it, first in line, to start again from its committed tokens (prompt and every token emitted) once the
        target answers.  Its next step starts where the lost one did, and every draw is a function of (seed, step
        start, offset, purpose) (:class:`cluster.core.draws.CounterDraws`), so the stream goes on exactly as
        if nothing had happened: no token repeated or missing.  At most ``resume_limit`` times per request."""
        seq.resumes += 1
        log.warning("request %s lost its state on %s: resuming from %d tokens (%d of %d)", seq.rid, self.target,
                    len(seq.ctx.tokens), seq.resumes, self.resume_limit)
        for name in seq.req.strategy.roles():
            try:
                self.models[name].release(seq.rid)
            except Exception:                            # noqa: BLE001 - a dead model holds nothing anyway
                log.debug("release of %s on %s failed", seq.rid, name, exc_info=True)
        seq.stale.clear()
        seq.ctx.behind.clear()
        with self._lock:
            self.scheduler.requeue(seq)

    def _fail(self, seq: Sequence, error: BaseException, finish: str = "error") -> None:
        log.error("request %s failed: %s: %s", seq.rid, type(error).__name__, error)
        seq.error, seq.finish = error, finish
        self._end(seq)

    def _end(self, seq: Sequence) -> None:
        """Release the request's state on every model it used and take it out of the batch."""
        if seq.status == FINISHED:
            return
        for name in seq.req.strategy.roles():
            try:
                self.models[name].release(seq.rid)
            except Exception:                            # noqa: BLE001 - a dead model must not block others
                log.exception("release of %s on %s failed", seq.rid, name)
        with self._lock:
            self.scheduler.remove(seq)
        self._ended.append(seq)          # live, and on_end, until the step's flush has released its state

    # -- prefill, and the target-only steps of a request whose drafters hold no state -----------------------
    # A request's models that hold no state for it are *stale* (``Sequence.stale``): on joining, a request whose
    # first step the policy makes plain (SpeculationPolicy.starts_plain) is prefilled on the target only; a model
    # that went down and came back (cluster.engine.health) lost its requests' state.  A request with a stale model
    # steps target-only (a plain autoregressive step: exactly the target's law).  At the first step the policy has
    # it draft, its stale models that answer are prefilled with the committed tokens (one batched call per model)
    # and the strategy's own steps take over; while the policy keeps it plain they stay stale, so plain decoding
    # pays no drafter.
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
            scored = [s for s in items if name == self.target and s.wants_scores] if names is None else []
            try:
                plain = [s for s in items if s not in scored]
                hits = self.models[name].prefill_batch([_prefill_item(s) for s in plain])
                if name == self.target and names is None and hits:     # the prefix cache's hits (usage)
                    for s, hit in zip(plain, hits):
                        if not s.resumes:
                            s.ctx.stats.cached_tokens = int(hit)
                if scored:          # the prompt's logprobs from the forward that fills the target's cache
                    rows = prefill_scored(self.models[name], [_prefill_item(s) for s in scored])
                    for s, logits in zip(scored, rows):
                        s.set_scores(logits)
                for s in items:
                    s.stale.discard(name)
                    s.ctx.behind.pop(name, None)         # prefilled with every committed token
            except ModelUnavailableError as e:
                self.model_down(name, e)
                if name == self.target:                  # nothing can go on without it
                    for s in items:
                        self._suspend(s) if self._resumable(s, e) else self._fail(s, e)
            except Exception as e:                       # noqa: BLE001 - fails these requests only
                for s in items:
                    self._fail(s, e)

    def _step_of(self, seq: Sequence):
        """The request's strategy step, or a target-only step while one of its models is down or stale."""
        roles = set(seq.req.strategy.roles()) - {self.target}
        if roles & (self.health.down | seq.stale):
            return self._fallback.step(seq.ctx)
        return seq.req.strategy.step(seq.ctx)

    # -- driven from the caller's thread (the CLI, tests, benchmarks): each call steps the engine itself until
    # its requests end; on the cluster a step-loop thread drives it instead (serving.control.coordinator)
    def generate(self, req: GenerationRequest | PreparedRequest) -> GenerationResult:
        for chunk in self.stream(req):
            pass
        return chunk.result

    def stream(self, req: GenerationRequest | PreparedRequest) -> Iterator[StreamChunk]:
        """Yield one :class:`StreamChunk` per step; the last one carries the :class:`GenerationResult`.
        Closing the iterator cancels the request and releases its state on every model."""
        seq = self.add(req)
        try:
            while True:
                if seq.status != FINISHED:
                    self.step()
                while seq.chunks:
                    yield seq.chunks.pop(0)
                if seq.status == FINISHED:
                    break
            if seq.error is not None:
                raise seq.error
        finally:
            if seq.status != FINISHED:
                self.abort(seq.rid)
                self.step()

    def generate_many(self, reqs: list[GenerationRequest | PreparedRequest]) -> list[GenerationResult]:
        """Run ``reqs`` together (continuous batching within this call); results in order."""
        seqs = [self.add(r) for r in reqs]
        while any(s.status != FINISHED for s in seqs):
            self.step()
        for s in seqs:
            if s.error is not None:
                raise s.error
        return [s.result for s in seqs]


def _prefill_item(s: Sequence) -> PrefillItem:
    """``s`` as a prefill item: its committed tokens, and its cache salt for what handles keep across requests."""
    return PrefillItem(s.rid, list(s.ctx.tokens), s.req.sampling, s.req.seed, s.req.cache_salt or "")
