"""The transport seam: what a remote handle, the unit builder and the watchdog need of the way to a model.

A :class:`Channel` carries one per-step call (:class:`actors.protocol.StepCall`: the queued bookkeeping plus
one batched method) to where a model runs and brings its packed answer back; it asks every rank a question
(``info``, ``health``, ``active_requests``) without waiting (:class:`Pending`); and once it has found the model
gone it fails fast until :meth:`Channel.probe` sees it answer again -- where a model cannot come back by itself
(a tensor-parallel group), the probe runs the channel's restart hook.  :class:`cluster.serving.control.ray_channel.RayChannel`
is the Ray implementation (actor calls); another transport plugs in here without touching the engine, the
remote handle, the unit builder or the coordinator's watchdog (the tests' in-process channel is one).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from actors.protocol import StepCall

ASKS = ("info", "health", "active_requests", "cache_info")


class Pending(Protocol):
    def wait(self, timeout_s: float) -> list:
        """Every rank's answer, in rank order; raises when one does not answer within ``timeout_s`` or is gone."""


class Channel(ABC):
    """One model's transport (one process, or the ranks of a tensor-parallel group); see the module docstring."""

    name: str = "model"
    ranks: int = 1                 # processes every call goes to (in the same order); rank 0 answers
    timeout_s: float = 300.0       # how long a call may take before the model counts as not answering
    down: bool = False

    @abstractmethod
    def call(self, step: StepCall) -> tuple[Any, float]:
        """-> (rank 0's packed result, its compute seconds); :class:`cluster.errors.ModelUnavailableError` when
        the model is gone or does not answer in time (the channel is then down until :meth:`probe`)."""

    @abstractmethod
    def ask(self, question: str) -> Pending:
        """Start ``question`` (one of :data:`ASKS`) on every rank; returns at once."""

    @abstractmethod
    def probe(self) -> bool:
        """Non-blocking, while down: True once every rank answers again (restarted where needed)."""

    def mark_down(self) -> None:
        """The watchdog found it not answering: calls fail fast until :meth:`probe` sees it back."""
        self.down = True

    def close(self) -> None:
        """Stop what the channel started (actors, groups); nothing by default."""

    def health(self) -> list[dict]:
        return self.ask("health").wait(self.timeout_s)
