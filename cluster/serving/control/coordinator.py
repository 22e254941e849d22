"""The coordinator of one serving unit: the continuous-batching engine over remote model handles.

It starts the unit's actors (:func:`cluster.serving.control.unit.build_unit`), builds the same
:class:`cluster.engine.Engine` the in-process runtime uses over :class:`cluster.serving.control.remote.RemoteHandle` s,
and runs ONE step loop in a background thread: every step advances every running request, with one batched
call per model.  Async callers (:mod:`cluster.serving.fronts.app`) add requests and read their chunks from a queue;
admission beyond ``engine.max_batch`` waits (up to ``engine.max_queue``) and beyond that is refused with
:class:`cluster.errors.OverloadedError` at once.  A request's state is released on every model when it ends,
fails or is cancelled; a cancelled request stops at the next step boundary.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
import uuid
from typing import AsyncIterator


from cluster.config.schema import Config
from cluster.core.draft.programs import DRAFTS
from cluster.engine.engine import Engine
from cluster.engine.request import (
    GenerationRequest,
    GenerationResult,
    PreparedRequest,
    StreamChunk,
)
from cluster.engine.sequence import WAITING, Sequence
from cluster.errors import ModelUnavailableError
from cluster.models.host import setup_process
from cluster.serving.control.chunks import ChunkBox, StepDelivery, paced, wake_rule
from cluster.serving.ops.metrics import Timeline
from cluster.serving.control.unit import build_unit
from cluster.strategies import REGISTRY

log = logging.getLogger("specserve.coordinator")

WARMUP_PROMPT = "def main():\n    "


class Coordinator:
    """One serving unit's engine, its step loop, and request bookkeeping (see the module docstring)."""

    def __init__(self, cfg: Config, *, topology: str | None = None, metrics=None):
        setup_process(cfg.cluster.coordinator.threads)   # this process runs models too (one thread)
        self.cfg, self.topology = cfg, topology or cfg.cluster.placement()[0]
        if topology is None:
            log.info("topology %s (%s)", self.topology, cfg.cluster.placement()[1])
        self.entries, models, self.tokenizer, self._channels = build_unit(cfg, self.topology)
        self.engine = Engine.configured(models, self.tokenizer, cfg.engine)
        self.max_batch, self.max_queue = cfg.engine.max_batch, cfg.engine.max_queue
        self.recent: collections.deque = collections.deque(maxlen=64)   # (rid, strategy, outcome, tokens)
        self.cache_tokens = [0, 0]           # prompt tokens of finished requests, of them found in the prefix cache
        self.metrics = metrics
        self._spec_seen: tuple = (None, {})        # the speculation counters last recorded (their object, values)
        self._timelines: dict[Sequence, Timeline] = {}     # live streamed requests not yet in the batch
        self.warm = False
        self._wake = threading.Condition()
        self._delivery = StepDelivery()      # streamed chunks: one wake-up per event loop per step
        self._stop = threading.Event()
        self._stopped = False
        self._loop = threading.Thread(target=self._run, daemon=True, name="specserve-step-loop")
        self._loop.start()
        self._watch = threading.Thread(target=self._watchdog, daemon=True, name="specserve-watchdog")
        self._watch.start()

    @property
    def ready(self) -> bool:
        """SERVING: warmed up and the target answers (a dead target flips this within a watchdog period)."""
        return self.warm and self.cfg.target not in self.engine.health.down

    def _watchdog(self, period_s: float = 1.0) -> None:
        """Ping every actor each ``period_s``: mark a model down as soon as it stops answering (health turns
        NOT_SERVING at once for the target), and probe the ones that are down until they are back."""
        channels = {n: e.handle.channel for n, e in self.entries.items() if e.placement != "local"}
        while not self._stopped:
            asked = {n: ch.ask("health") for n, ch in channels.items() if n not in self.engine.health.down}
            deadline = time.perf_counter() + 2.0 * period_s
            for name, pending in asked.items():
                try:
                    pending.wait(max(0.01, deadline - time.perf_counter()))
                except Exception as e:                  # noqa: BLE001 - dead, restarting or hung
                    channels[name].mark_down()          # calls fail fast until a probe answers
                    self.engine.model_down(name, e)
            if self.engine.health.down:
                self.engine.health.refresh()
                self._notify()
            if self.metrics is not None:         # the gauges, every round (never raises)
                self.metrics.set_models_up({n: n not in self.engine.health.down for n in self.entries})
                self._record_speculation()
            self._stop.wait(period_s)

    def _record_speculation(self) -> None:
        """The speculation cache's counters since the last round, to the metrics (the ``speculator`` topology)."""
        cache = getattr(self.engine.models.get(DRAFTS), "cache", None)
        if cache is not None:
            c, now = cache.counters, cache.counters.as_dict()
            prev = self._spec_seen[1] if self._spec_seen[0] is c else {}       # reset by the benchmark: from 0
            self.metrics.record_speculation({k: v - prev.get(k, 0) for k, v in now.items()})
            self._spec_seen = (c, now)

    # -- the step loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self.engine.has_work:
                    self._wake.wait()
                if self.engine.target_down and not self._stopped:   # its requests wait for it: no step can
                    self._wake.wait(1.0)                             # run, until the watchdog's next round
                if self._stopped:
                    return
            started = time.perf_counter()
            try:
                self.engine.step()
            except Exception:                    # noqa: BLE001 - the loop must survive; requests failed inside
                log.exception("engine step failed")
            self._delivery.deliver()
            for seq, timeline in list(self._timelines.items()):    # joined the batch in this step
                if seq.status != WAITING:
                    timeline.scheduled = max(timeline.queued, started)
                    self._timelines.pop(seq, None)
            if self.metrics is not None:         # the running / waiting / KV gauges (never raises)
                sched = self.engine.scheduler
                self.metrics.set_load(len(sched.running), len(sched.waiting), sched.kv_reserved / self._kv_capacity())

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    # -- admission ----------------------------------------------------------------------------------
    def prepare(self, req: GenerationRequest | PreparedRequest) -> PreparedRequest:
        """Validate and tokenize ``req`` once (raises ParamError): the prepared request flows down."""
        return self.engine.prepare(req)

    async def stream(self, req: GenerationRequest | PreparedRequest, *, whole: bool = False
                     ) -> AsyncIterator[StreamChunk]:
        """Validate, admit and run ``req``; yield its chunks, coalesced and paced by ``cluster.stream``
        (:mod:`cluster.serving.control.chunks`; ``whole``: only the last chunk, holding everything).  Closing the
        iterator (or cancelling the task consuming it) stops the generation at the next step boundary and frees
        its state everywhere."""
        req = self.prepare(req)
        pace = self.cfg.cluster.stream
        box = ChunkBox(asyncio.get_running_loop(), self._delivery,
                       wake_on=wake_rule(whole, pace.interval_tokens, pace.interval_ms))
        admitted = time.perf_counter()
        timeline = Timeline(admitted)

        def sink(chunk: StreamChunk) -> None:
            if chunk.token_ids:
                timeline.tokens()
            box.put(chunk)

        def on_end(seq: Sequence) -> None:
            self._timelines.pop(seq, None)
            self._record(seq, admitted, timeline)
            box.put(seq)

        seq = self.engine.add(req, sink, on_end)    # ParamError / OverloadedError: refused at once
        if seq.status == WAITING:                   # the step loop stamps when it joins the batch
            self._timelines[seq] = timeline
        else:                                       # joined in a step that began meanwhile
            timeline.scheduled = time.perf_counter()
        self._notify()
        try:
            async for chunk in paced(box, lambda item: isinstance(item, Sequence), whole=whole,
                                     interval_tokens=pace.interval_tokens, interval_ms=pace.interval_ms):
                yield chunk
        finally:
            if seq.finish is None:                  # the reader left before the end: stop it
                self.engine.abort(req.rid)
                self._notify()

    async def generate(self, req: GenerationRequest | PreparedRequest) -> GenerationResult:
        async for chunk in self.stream(req, whole=True):
            if chunk.result is not None:
                return chunk.result
        raise RuntimeError("generation ended without a result")

    def generate_blocking(self, req: GenerationRequest | PreparedRequest,
                          timeout: float | None = None) -> GenerationResult:
        """For synchronous callers (benchmarks, warm-up): run ``req`` on the step loop and wait."""
        done = threading.Event()
        seq = self.engine.add(req, on_end=lambda s: done.set())
        self._notify()
        if not done.wait(timeout):
            self.engine.abort(seq.rid)
            self._notify()
            raise TimeoutError(f"request {seq.rid} took longer than {timeout}s")
        if seq.error is not None:
            raise seq.error
        return seq.result

    def _kv_capacity(self) -> int:
        """KV positions the unit's running requests may reserve: the engine's KV budget (configured or derived
        from device memory), else ``max_batch`` rows of the target's full length."""
        budget = self.engine.scheduler.limits.kv_budget_tokens
        return budget or self.max_batch * max(1, int(self.engine.models[self.cfg.target].max_length))

    def _record(self, seq: Sequence, admitted: float, timeline: Timeline | None = None) -> None:
        outcome = {"error": "error", "cancelled": "cancelled", "deadline": "deadline"}.get(seq.finish, "ok")
        self.recent.append((seq.rid, seq.req.strategy_name, outcome, len(seq.generated)))
        if seq.result is not None:                 # the prefix cache's hit rate, for ServerInfo
            self.cache_tokens[0] += seq.result.stats.prompt_tokens
            self.cache_tokens[1] += seq.result.stats.cached_tokens
        if self.metrics is not None:
            try:
                self.metrics.record(seq.req.strategy_name, outcome, seq.result, time.perf_counter() - admitted,
                                    error=seq.error, timeline=timeline)   # marked: the fronts do not count it again
            except Exception:                    # metrics never fail a request
                log.exception("metrics")

    # -- warm-up, health, introspection ------------------------------------------------------------
    def warmup(self, tokens: int | None = None) -> None:
        """Run every registered strategy the unit can serve for a few tokens (together); then ``ready``."""
        tokens = self.cfg.cluster.warmup_tokens if tokens is None else tokens
        if tokens:
            done, seqs = threading.Semaphore(0), []
            for name in sorted(REGISTRY):
                req = GenerationRequest(prompt=WARMUP_PROMPT, max_new_tokens=tokens, seed=0, strategy=name,
                                        request_id=f"warmup-{name}-{uuid.uuid4().hex[:8]}", ignore_eos=True)
                try:
                    seqs.append(self.engine.add(req, on_end=lambda s: done.release()))
                except Exception as e:           # a strategy this unit cannot serve (missing model)
                    log.warning("warm-up of %s skipped: %s", name, e)
            self._notify()
            for _ in seqs:
                done.acquire()
            for s in seqs:
                if s.error is not None:
                    log.warning("warm-up of %s failed: %s", s.req.strategy_name, s.error)
        self.warm = True

    def health(self) -> dict:
        """Serve's replica health check: ping the target's actors (raises if one is gone: nothing is served
        without it, and Serve replaces the unit).  A target the watchdog has marked down is not pinged: for
        ``cluster.target_restart_grace_s`` it counts as restarting (Ray restarts the actor, the unit rebuilds a TP
        group) and the check passes, so the requests waiting for it resume on it (``engine.resume_limit``); past
        that the check fails and Serve replaces the unit.  A drafter that does not answer fails no check: the
        watchdog has marked it down, its requests go on on the target alone and speculation resumes once it is
        back (cluster/engine/health.py); failing here would make Serve kill the whole unit, requests and all."""
        out = {}
        for e in self.entries.values():
            if e.placement != "local" and e.name == self.cfg.target:
                down = self.engine.health.down_for(e.name)
                if down is None:
                    out[e.name] = e.handle.channel.health()
                elif down <= self.cfg.cluster.target_restart_grace_s:
                    out[e.name] = "restarting"
                else:
                    raise ModelUnavailableError(e.name, f"down for {down:.0f}s, past "
                                                        f"cluster.target_restart_grace_s")
            else:
                out[e.name] = "down" if e.name in self.engine.health.down else "ok"
        return out

    def live_requests(self) -> list[Sequence]:
        return self.engine.live()

    def active_requests(self) -> dict[str, list[str]]:
        """Per model, the request ids holding state there (asks the actors)."""
        return {n: list(e.handle.active_requests()) for n, e in self.entries.items()}

    def cache_info(self) -> dict[str, dict]:
        """Per model, its prefix cache's size now (asks the actors; a model that does not answer has none listed:
        the operators' view must not fail on a model that is down)."""
        out = {}
        for n, e in self.entries.items():
            if e.role == "draft-side":
                continue
            try:
                out[n] = e.handle.cache_info()
            except Exception:                # noqa: BLE001 - down or restarting: no figure for it this time
                out[n] = {}
        return out

    def timings(self) -> dict:
        return {n: e.handle.timing for n, e in self.entries.items() if e.placement != "local"}

    def draft_timing(self, reset: bool = False) -> dict | None:
        """The draft side's ``draft_batch`` calls since the last reset, as a dict of
        :class:`cluster.serving.control.remote.CallTiming`'s totals (the served benchmark's hop columns); in the
        ``speculator`` topology ``{"cache": CacheCounters as a dict}``; None when the draft side runs in this
        process otherwise."""
        e = self.entries.get(DRAFTS)
        if e is not None and hasattr(e.handle, "cache"):     # speculator: the speculation cache's counters
            out = {"cache": e.handle.cache.counters.as_dict()}
            if reset:
                e.handle.cache.counters = type(e.handle.cache.counters)()
            return out
        if e is None or e.placement == "local":
            return None
        t = e.handle.per_method.get("draft_batch")
        if reset:
            e.handle.reset_timing()
        return dataclasses.asdict(t) if t is not None else {}

    def reset_timings(self) -> None:
        for e in self.entries.values():
            if e.placement != "local":
                e.handle.reset_timing()

    def shutdown(self) -> None:
        self._stop.set()
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        for ch in self._channels:
            try:
                ch.close()
            except Exception:
                log.exception("killing actors")
