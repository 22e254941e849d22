"""The Ray implementation of the transport seam (:class:`cluster.serving.control.channel.Channel`): actor calls.

A :class:`RayChannel` is one model actor, or the rank actors of a tensor-parallel group (every call goes to
every rank, in the same order, and rank 0's answer is returned).  Per-step calls are plain Ray actor calls
(:mod:`actors.model_actor` says why not compiled graphs).  Ray is imported inside the methods: the module loads without it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from actors.protocol import StateLostError, StepCall
from cluster.errors import ModelUnavailableError
from cluster.serving.control.channel import ASKS, Channel

log = logging.getLogger("specserve.remote")
WAIT_SLICE_S = 0.5      # how often a waiting call looks whether the watchdog marked its channel down


class _RayPending:
    """Object refs of one call on every rank; :meth:`wait` gives up early once the channel is marked down (a call
    to a dead actor Ray restarts would otherwise wait all of its timeout)."""

    def __init__(self, channel: "RayChannel", refs: list):
        self.channel, self.refs = channel, refs

    def wait(self, timeout_s: float) -> list:
        import ray
        from ray.exceptions import GetTimeoutError
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(self.refs, timeout=max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
            except GetTimeoutError:
                if self.channel.down:
                    raise ModelUnavailableError(self.channel.name, "marked down while a call waited") from None
                if time.monotonic() >= deadline:
                    raise


class RayChannel(Channel):
    """One model actor (``len(actors) == 1``) or a lockstep tensor-parallel group, called through Ray.

    A single actor is restarted by Ray (``max_restarts``).  A group cannot take a restarted rank back into its
    ``torch.distributed`` process group, so a group channel has a restart hook, ``restart`` (``() -> (actors,
    placement group)``): once the group is down, :meth:`probe` kills every rank and starts a whole new group.

    Once a call found it gone (or the watchdog did, :meth:`mark_down`), calls fail at once with
    :class:`ModelUnavailableError` until :meth:`probe` sees it answer: a dead actor that Ray restarts stays
    pending until some node can host it (its node may be gone for good), and each call would otherwise wait
    ``timeout_s``; the engine's end-of-step releases would stall the step loop that long."""

    def __init__(self, actors: list, *, name: str = "model", timeout_s: float = 300.0, placement_group=None,
                 restart: Callable[[], tuple[list, object]] | None = None):
        self.actors, self.timeout_s, self.placement_group = list(actors), timeout_s, placement_group
        self.name = name
        self._submit = threading.Lock()      # every rank must see calls in the same order
        self._probe = None
        self._restart = restart
        self._restarting: threading.Thread | None = None
        self._restarted = False
        self.down = False

    @property
    def ranks(self) -> int:
        return len(self.actors)

    def _start(self, method: str, *args) -> _RayPending:
        with self._submit:
            return _RayPending(self, [getattr(a, method).remote(*args) for a in self.actors])

    def ask(self, question: str) -> _RayPending:
        if question not in ASKS:
            raise ValueError(f"unknown question {question!r}")
        return self._start(question)

    def call(self, step: StepCall):
        """-> (result of rank 0, its compute seconds); :class:`ModelUnavailableError` when an actor is gone
        or does not answer within ``timeout_s`` (Ray restarts a dead model actor; see ``probe``)."""
        if self.down:
            raise ModelUnavailableError(self.name, "down until it answers again")
        try:
            return self._call(step)
        except ModelUnavailableError:
            self.down = True
            raise

    def _call(self, step: StepCall):
        from ray.exceptions import (
            ActorUnavailableError,
            GetTimeoutError,
            RayActorError,
            RayTaskError,
        )
        try:
            return self._start("step", step).wait(self.timeout_s)[0]
        except (RayActorError, ActorUnavailableError) as e:
            raise ModelUnavailableError(self.name, "gone (its actor died)") from e
        except RayTaskError as e:
            if isinstance(e.cause, StateLostError):       # restarted before anyone noticed: state is gone
                raise ModelUnavailableError(self.name, "restarted") from e
            if self._restart is not None and not self._all_answer():   # a collective failed: a rank died
                raise ModelUnavailableError(self.name, "a tensor-parallel rank died") from e
            raise
        except GetTimeoutError as e:
            raise ModelUnavailableError(self.name, f"not answering within {self.timeout_s:g}s") from e

    def _all_answer(self, timeout_s: float = 2.0) -> bool:
        try:
            self.ask("health").wait(timeout_s)
            return True
        except Exception:                                # noqa: BLE001 - dead, restarting or hung
            return False

    def probe(self) -> bool:
        """Non-blocking: True once every actor answers a health call again (after a restart; a group: once
        it has been restarted, see the class docstring)."""
        import ray
        if self._restart is not None:
            self.down = not self._probe_group()
            return not self.down
        # one snapshot of the pending probe: the coordinator's loop and the engine's step both probe (health.refresh)
        # from their threads, so the other may take the probe (set it to None) between two reads of the attribute
        refs = self._probe
        if refs is None:
            refs = self._probe = self.ask("health").refs
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(ready) < len(refs):
            return False
        self._probe = None
        try:
            ray.get(refs, timeout=1.0)
            self.down = False
            return True
        except Exception:                                # noqa: BLE001 - still down: probe again later
            return False

    def _probe_group(self) -> bool:
        if self._restarting is None:                     # first probe after the group went down
            self._restarted = False
            self._restarting = threading.Thread(target=self._restart_group, daemon=True,
                                                name=f"specserve-rebuild-{self.name}")
            self._restarting.start()
            return False
        if self._restarting.is_alive():
            return False
        self._restarting = None                          # done: a failed attempt is retried at the next probe
        return self._restarted

    def _restart_group(self) -> None:
        try:
            self.close()                                 # also unblocks a rank waiting in a collective
            actors, pg = self._restart()
            with self._submit:
                self.actors, self.placement_group = list(actors), pg
            self._restarted = True
            log.warning("tensor-parallel group %s rebuilt (%d ranks)", self.name, len(actors))
        except Exception:                                # noqa: BLE001 - logged; the next probe tries again
            log.exception("rebuilding tensor-parallel group %s failed", self.name)

    def close(self) -> None:
        import ray
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:                            # noqa: BLE001 - already gone
                pass
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.placement_group)
            self.placement_group = None
