"""Which models of an engine are down, and the fallback that keeps their requests going.

When a drafter (or the Max-Gram drafter) stops answering (:class:`ModelUnavailableError`), the engine marks it
down and its requests continue on the target alone: each step becomes a plain autoregressive step, which emits
exactly the target's distribution, so lossless strategies keep their output law.  A request's state on a model
that went down is *stale*; once the model answers again (its handle's ``probe()``: e.g. a restarted actor), the
engine prefills it with the request's committed tokens and speculation resumes.  The target going down takes every
request's state with it: its requests wait and start again from their committed tokens once it answers
(``Engine._suspend``, up to ``resume_limit`` times), or fail with :class:`ModelUnavailableError` without a resume
limit; new requests are refused until it answers again.
"""
from __future__ import annotations

import logging
import time

from cluster.core.interfaces import BatchedHandle

log = logging.getLogger("specserve.engine")


class ModelHealth:
    def __init__(self, models: dict[str, BatchedHandle]):
        self.models = models
        self.down: set[str] = set()
        self._since: dict[str, float] = {}        # a model that is down -> when it was marked down (monotonic)

    def mark_down(self, name: str, why: BaseException) -> None:
        if name not in self.down:
            log.warning("model %s is down (%s); its requests continue without it", name, why)
            self._since[name] = time.monotonic()
        self.down.add(name)

    def down_for(self, name: str) -> float | None:
        """Seconds since ``name`` went down; None while it answers."""
        return time.monotonic() - self._since[name] if name in self.down else None

    def refresh(self) -> set[str]:
        """Probe the models that are down; returns the ones that answer again."""
        back = set()
        for name in list(self.down):
            if self.models[name].probe():
                back.add(name)
        if back:
            log.warning("model(s) %s answer again", ", ".join(sorted(back)))
        self.down -= back
        for name in back:
            self._since.pop(name, None)
        return back
