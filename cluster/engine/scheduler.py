"""Continuous-batching admission: who waits, who runs, and what is refused.  Holds no torch.

Requests join the running batch between engine steps while the batch has room (``max_batch``) and the
KV budget (``kv_budget_tokens``: the sum over running requests of prompt + ``max_new_tokens`` + 1) allows;
the rest wait in arrival order, up to ``max_queue``; beyond that :meth:`Scheduler.add` refuses with
:class:`OverloadedError`.  Requests leave when they finish, fail or are cancelled.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cluster.engine.sequence import FINISHED, RUNNING, WAITING, Sequence
from cluster.errors import OverloadedError


@dataclass(frozen=True)
class Limits:
    max_batch: int = 32                # requests decoded together in one step
    max_queue: int = 256               # requests waiting for a place in the batch
    kv_budget_tokens: int | None = None   # KV positions all running requests may reserve (None: unlimited)


class Scheduler:
    def __init__(self, limits: Limits = Limits()):
        self.limits = limits
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.kv_reserved = 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        budget = self.limits.kv_budget_tokens
        if budget is not None and seq.reserved_tokens > budget:
            raise OverloadedError(f"request needs {seq.reserved_tokens} KV positions (prompt + max_new_tokens + 1), "
                                  f"more than the whole KV budget engine.kv_budget_tokens = {budget}")
        if self._would_wait([*self.waiting, seq]) > self.limits.max_queue:
            raise OverloadedError(f"server busy: {len(self.running)} running and {len(self.waiting)} waiting "
                                  f"(max_batch {self.limits.max_batch}, max_queue {self.limits.max_queue})")
        self.waiting.append(seq)

    def _would_wait(self, queue: list[Sequence]) -> int:
        """How many of ``queue`` would still wait after the next :meth:`schedule` (joining in order)."""
        rows, reserved, budget = len(self.running), self.kv_reserved, self.limits.kv_budget_tokens
        for i, seq in enumerate(queue):
            if rows >= self.limits.max_batch or (budget is not None and reserved + seq.reserved_tokens > budget):
                return len(queue) - i
            rows, reserved = rows + 1, reserved + seq.reserved_tokens
        return 0

    def _fits(self, seq: Sequence) -> bool:
        budget = self.limits.kv_budget_tokens
        return len(self.running) < self.limits.max_batch and \
            (budget is None or self.kv_reserved + seq.reserved_tokens <= budget)

    def schedule(self) -> list[Sequence]:
        """Move waiting requests into the batch while they fit (in order); returns the ones that joined."""
        joined = []
        while self.waiting and self._fits(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.status = RUNNING
            self.running.append(seq)
            self.kv_reserved += seq.reserved_tokens
            joined.append(seq)
        return joined

    def requeue(self, seq: Sequence) -> None:
        """Put running ``seq`` back at the head of the queue (it lost its state: it joins again, first; an
        admitted request is never refused for the queue's length)."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv_reserved -= seq.reserved_tokens
        seq.status = WAITING
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out (finished, failed or cancelled), waiting or running."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv_reserved -= seq.reserved_tokens
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = FINISHED
