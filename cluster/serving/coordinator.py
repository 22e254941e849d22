"""The coordinator of one serving unit: the in-process engine over remote model handles.

It starts the unit's actors (the target, or its tensor-parallel group, and -- in the ``separated``
topology -- one actor per drafter), builds :class:`cluster.engine.Engine` over
:class:`cluster.serving.remote.RemoteHandle` s (drafters of the ``default`` topology run in-process), and
serves many requests concurrently: ``max_concurrent`` decode at once on a thread pool, up to
``max_queue`` more wait, and beyond that a request is refused with
:class:`cluster.errors.OverloadedError`.  A request's state is released on every model when it ends,
fails or is cancelled (the engine's ``finally``), and a cancelled request stops after its current
step.  This module is what the Ray Serve deployment (:mod:`cluster.serving.app`) runs.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from cluster.config.schema import Config
from cluster.engine.engine import Engine
from cluster.engine.request import (
    GenerationRequest,
    GenerationResult,
    PreparedRequest,
    StreamChunk,
)
from cluster.errors import OverloadedError, ParamError
from cluster.serving.unit import build_unit
from cluster.strategies import REGISTRY

log = logging.getLogger("specserve.coordinator")


WARMUP_PROMPT = "def main():\n    "


class Cancelled(Exception):
    """The client went away; the request was stopped and its state released."""


@dataclass
class Live:
    rid: str
    strategy: str
    admitted: float
    state: str = "queued"          # queued | running


class Coordinator:
    """One serving unit's engine, request admission and bookkeeping (see the module docstring)."""

    def __init__(self, cfg: Config, *, topology: str | None = None, transport: str | None = None, metrics=None):
        self.cfg, self.topology = cfg, topology or cfg.cluster.topology
        self.transport = transport or cfg.cluster.transport
        self.entries, self.tokenizer, self._endpoints = build_unit(cfg, self.topology, self.transport)
        self.engine = Engine({n: e.handle for n, e in self.entries.items()}, self.tokenizer,
                             target=cfg.target, default_strategy=cfg.engine.strategy,
                             defaults=cfg.engine.options, max_new_tokens_limit=cfg.engine.max_new_tokens_limit)
        cl = cfg.cluster
        self.max_concurrent, self.max_queue = cl.max_concurrent, cl.max_queue
        self._pool = ThreadPoolExecutor(cl.max_concurrent, thread_name_prefix="specserve-req")
        self._live: dict[str, Live] = {}
        self.recent: collections.deque = collections.deque(maxlen=64)   # (rid, strategy, outcome, tokens)
        self._lock = threading.Lock()
        self.metrics = metrics
        self.ready = False

    # -- admission ------------------------------------------------------------------------------
    def validate(self, req: GenerationRequest | PreparedRequest) -> PreparedRequest:
        """Validate and tokenize ``req`` once (raises ParamError): the prepared request flows down."""
        return self.engine.prepare(req)

    def _admit(self, req: PreparedRequest) -> Live:
        with self._lock:
            if req.rid in self._live:
                raise ParamError("request_id", "an id not used by a live request", req.rid)
            if len(self._live) >= self.max_concurrent + self.max_queue:
                raise OverloadedError(f"server busy: {len(self._live)} requests in flight "
                                      f"(max_concurrent {self.max_concurrent} + max_queue {self.max_queue})")
            live = self._live[req.rid] = Live(req.rid, req.strategy_name, time.perf_counter())
            return live

    def _finish(self, live: Live) -> None:
        with self._lock:
            self._live.pop(live.rid, None)

    # -- serving ----------------------------------------------------------------------------------
    async def stream(self, req: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Validate, admit and run ``req``; yield its chunks. Closing the iterator (or cancelling the
        task consuming it) stops the generation after its current step and frees its state."""
        req = self.validate(req)
        live = self._admit(req)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def emit(kind: str, item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, item))

        fut = loop.run_in_executor(self._pool, self._run, req, live, emit, cancel)
        done = False
        try:
            while True:
                kind, item = await queue.get()
                if kind == "error":
                    done = True
                    raise item
                done = item.finish_reason is not None
                yield item
                if done:
                    break
        finally:
            if not done:
                cancel.set()
                if fut.cancel():                 # still queued: never started
                    self._finish(live)
                    self._record(req.strategy_name, "cancelled", None, live)

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        async for chunk in self.stream(req):
            if chunk.result is not None:
                return chunk.result
        raise RuntimeError("generation ended without a result")

    def _run(self, req: PreparedRequest, live: Live, emit: Callable, cancel: threading.Event) -> None:
        """Worker thread: drive the engine's generator, stopping between steps when cancelled."""
        outcome, result, generated = "error", None, 0
        try:
            if cancel.is_set():
                outcome = "cancelled"
                return
            live.state = "running"
            gen = self.engine.stream(req)
            try:
                for chunk in gen:
                    generated += len(chunk.token_ids)
                    if chunk.result is not None:
                        result, outcome = chunk.result, "ok"
                    emit("chunk", chunk)
                    if cancel.is_set() and result is None:
                        outcome = "cancelled"
                        break
            finally:
                gen.close()                      # engine's finally: release on every model
        except BaseException as e:               # noqa: BLE001 - handed to the consumer
            log.exception("request %s failed", req.rid)
            emit("error", e)
        finally:
            self._finish(live)
            self._record(req.strategy_name, outcome, result, live, generated)

    def _record(self, strategy: str, outcome: str, result, live: Live, generated: int = 0) -> None:
        self.recent.append((live.rid, strategy, outcome, len(result.token_ids) if result else generated))
        if self.metrics is not None:
            try:
                self.metrics.record(strategy, outcome, result, time.perf_counter() - live.admitted)
            except Exception:                    # metrics never fail a request
                log.exception("metrics")

    # -- warm-up, health, introspection ------------------------------------------------------------
    def warmup(self, tokens: int | None = None) -> None:
        """Run every registered strategy the unit can serve for a few tokens; then ``ready``."""
        tokens = self.cfg.cluster.warmup_tokens if tokens is None else tokens
        if tokens:
            for name in sorted(REGISTRY):
                req = GenerationRequest(prompt=WARMUP_PROMPT, max_new_tokens=tokens, seed=0, strategy=name,
                                        request_id=f"warmup-{name}-{uuid.uuid4().hex[:8]}", ignore_eos=True)
                try:
                    self.engine.generate(req)
                except Exception as e:           # a strategy this unit cannot serve (missing model)
                    log.warning("warm-up of %s skipped: %s", name, e)
        self.ready = True

    def health(self) -> dict:
        """Ping every actor (raises if one is gone)."""
        return {e.name: (e.handle.endpoint.health() if e.placement != "local" else [{"ok": True}])
                for e in self.entries.values()}

    def live_requests(self) -> list[Live]:
        with self._lock:
            return list(self._live.values())

    def active_requests(self) -> dict[str, list[str]]:
        """Per model, the request ids holding state there (asks the actors)."""
        return {n: list(getattr(e.handle, "active_requests", list)()) for n, e in self.entries.items()}

    def timings(self) -> dict:
        return {n: e.handle.timing for n, e in self.entries.items() if e.placement != "local"}

    def reset_timings(self) -> None:
        for e in self.entries.values():
            if e.placement != "local":
                e.handle.reset_timing()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for ep in self._endpoints:
            try:
                ep.kill()
            except Exception:
                log.exception("killing actors")
