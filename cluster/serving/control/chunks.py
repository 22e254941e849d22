"""A streamed request's chunks on their way from the engine's step thread to the request's event loop.

Measured on this 2-core machine (issue 30), a streamed token cost plain decoding half its throughput at 16-32
clients: every engine chunk was its own ``call_soon_threadsafe`` wake-up of the replica's loop, its own item
through Serve's replica generator and proxy, and its own protobuf / SSE event.  Four cuts, all here:

* **One wake-up per loop per step.**  The step thread only appends a chunk to the request's :class:`ChunkBox`;
  the boxes touched in a step are woken together by :class:`StepDelivery` after the step (one
  ``call_soon_threadsafe`` per event loop, not one per request and chunk).
* **Coalescing.**  A reader that has not taken its chunks yet takes all of them at once, merged into one
  (:func:`merge_chunks`: every token id, text piece and logprob in order, the finish and result of the last).
* **A stream interval** (as vLLM's ``--stream-interval``; :class:`cluster.config.layout.StreamSpec`): after the
  first chunk with tokens, which is never held, chunks are held until they carry ``interval_tokens`` tokens or
  ``interval_ms`` has passed since the last one sent, or the request ends.
* **Wake-ups only for what is sent** (:func:`wake_rule`).  A unary call's box wakes its loop only for its last
  item, a stream's for its first chunk with tokens, each ``interval_tokens`` tokens and its last item, not once
  a step: the loop's Python ran beside every step, contending for the GIL (see :class:`ChunkBox`).

Formatting (protobuf, JSON) happens in the fronts on the event loop, once per sent chunk, never on the step
thread.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import AsyncIterator, Callable

from cluster.engine.request import StreamChunk


def merge_chunks(chunks: list[StreamChunk]) -> StreamChunk:
    """One chunk holding ``chunks`` in order: their ids, text and logprobs concatenated; the finish reason and
    result of the last (only the last chunk of a request has them)."""
    if len(chunks) == 1:
        return chunks[0]
    ids = [t for c in chunks for t in c.token_ids]
    logprobs = None if all(c.logprobs is None for c in chunks) else \
        [lp for c in chunks for lp in (c.logprobs or [])]
    last = chunks[-1]
    return StreamChunk(ids, "".join(c.text for c in chunks), last.finish_reason, last.result, logprobs)


class StepDelivery:
    """Collects the boxes that got something during a step; :meth:`deliver` wakes them, one call per loop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._due: dict[asyncio.AbstractEventLoop, list[ChunkBox]] = {}

    def mark(self, box: "ChunkBox") -> None:
        with self._lock:
            self._due.setdefault(box.loop, []).append(box)

    def deliver(self) -> None:
        """Wake every box marked since the last call (the step loop calls it after each step)."""
        with self._lock:
            due, self._due = self._due, {}
        for loop, boxes in due.items():
            try:
                loop.call_soon_threadsafe(_wake_all, boxes)
            except RuntimeError:              # that loop has closed: its readers are gone
                pass


def wake_rule(whole: bool, interval_tokens: int, interval_ms: float | None = None,
              clock: Callable[[], float] = time.perf_counter) -> Callable[[object], bool]:
    """The ``wake_on`` of a request's :class:`ChunkBox`: which items wake its reader.  Any item that is not a
    chunk (the ended sequence) and the chunk with a finish reason always do; otherwise ``whole`` (a unary call):
    none; a stream: its first chunk with tokens (never held, see :func:`paced`), then the chunk that brings the
    tokens since the last wake-up to ``interval_tokens``, or the first one put ``interval_ms`` or more after the
    last wake-up (so a slow stream still sends every ``interval_ms``).  For one box, called from one thread at a
    time."""
    since: int | None = None                  # tokens put since the last wake-up (None: none with tokens yet)
    woke = 0.0                                # when the last wake-up was asked for (``clock``)

    def wake(item) -> bool:
        nonlocal since, woke
        if not isinstance(item, StreamChunk) or item.finish_reason is not None:
            return True
        if whole or not item.token_ids:
            return False
        now, tokens = clock(), (since or 0) + len(item.token_ids)
        if not due(tokens, since is None, now - woke, interval_tokens, interval_ms):
            since = tokens
            return False
        since, woke = 0, now
        return True
    return wake


def due(tokens: int, first: bool, elapsed_s: float, interval_tokens: int, interval_ms: float | None) -> bool:
    """Whether ``tokens`` not yet sent (or not yet woken for) go now, ``elapsed_s`` after the last send (wake-up):
    the first ones (``first``) never wait; later ones once ``interval_tokens`` of them are in, or ``interval_ms``
    has passed.  One rule for both sides of a box: :func:`wake_rule` (the step thread) and :func:`paced` (the
    reader), so the reader is woken exactly when it would send."""
    if first:
        return tokens > 0
    return tokens >= interval_tokens or (interval_ms is not None and elapsed_s * 1e3 >= interval_ms)


def _wake_all(boxes: list["ChunkBox"]) -> None:
    for box in boxes:
        box.wake()


class ChunkBox:
    """One request's pending items (chunks, then possibly its ended sequence): filled by the step thread,
    emptied by the reader on ``loop``.  Woken through ``delivery`` at the end of the step (or at once without
    one); a box already waiting for its wake-up is not woken twice.  ``wake_on``: only the items it holds true
    of wake the reader (the others wait for the next one that does; :func:`wake_rule`).  The loop's Python then
    no longer runs beside every step, contending for the GIL with the step thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delivery: StepDelivery | None = None,
                 wake_on: Callable[[object], bool] | None = None):
        self.loop, self.delivery, self.wake_on = loop, delivery, wake_on
        self._pending: collections.deque = collections.deque()
        self._ready = asyncio.Event()
        self._lock = threading.Lock()
        self._signalled = False

    def put(self, item) -> None:
        """From any thread."""
        self._pending.append(item)
        if self.wake_on is not None and not self.wake_on(item):
            return
        with self._lock:
            if self._signalled:
                return
            self._signalled = True
        if self.delivery is not None:
            self.delivery.mark(self)
        else:
            self.loop.call_soon_threadsafe(self.wake)

    def wake(self) -> None:
        """On the loop: a later ``put`` schedules a new wake-up (cleared before the event is set, so no item
        appended meanwhile can be missed)."""
        with self._lock:
            self._signalled = False
        self._ready.set()

    async def take(self, timeout: float | None = None) -> list:
        """Everything pending, waiting for at least one item (or ``timeout`` seconds: then ``[]``).  The timeout
        is a timer that sets the event, not ``asyncio.wait_for``, which before Python 3.12 can swallow a
        cancellation that lands as the event is set (a cancelled stream would then run to its end)."""
        if not self._pending:
            self._ready.clear()
        if not self._pending:
            timer = None if timeout is None else self.loop.call_later(timeout, self._ready.set)
            try:
                await self._ready.wait()
            finally:
                if timer is not None:
                    timer.cancel()
        out = []
        while self._pending:
            out.append(self._pending.popleft())
        return out


def held_tokens(chunks: list[StreamChunk]) -> int:
    return sum(len(c.token_ids) for c in chunks)


async def paced(box: ChunkBox, is_end, *, interval_tokens: int = 1, interval_ms: float | None = None,
                whole: bool = False) -> AsyncIterator[StreamChunk]:
    """The request's chunks from ``box``, coalesced and paced (see the module docstring).  ``is_end(item)``
    tells the ended sequence from a chunk: it ends the stream (raising its error, if it failed, after the held
    chunks).  ``whole``: only the last chunk, holding everything (a unary call)."""
    held: list[StreamChunk] = []
    last_sent: float | None = None           # when the last chunk with tokens went out (None: none yet)
    while True:
        timeout = None
        if held and last_sent is not None and interval_ms is not None and not whole:
            timeout = max(0.0, last_sent + interval_ms / 1e3 - time.perf_counter())
        items = await box.take(timeout)
        end = None
        for item in items:
            if is_end(item):
                end = item
                break
            held.append(item)
        finished = bool(held) and held[-1].finish_reason is not None
        if held and (finished or end is not None or _due(held, last_sent, interval_tokens, interval_ms, whole)):
            chunk = merge_chunks(held)
            held = []
            if chunk.token_ids:
                last_sent = time.perf_counter()
            yield chunk
            if finished:
                return
        if end is not None:
            if getattr(end, "error", None) is not None:
                raise end.error
            return


def _due(held, last_sent, interval_tokens, interval_ms, whole) -> bool:
    elapsed = 0.0 if last_sent is None else time.perf_counter() - last_sent
    return not whole and due(held_tokens(held), last_sent is None, elapsed, interval_tokens, interval_ms)
