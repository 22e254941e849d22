"""A :class:`cluster.core.interfaces.ModelHandle` over Ray actors, so the unchanged engine drives remote models.

The engine calls the batched forms once per step and model (``prefill_batch``, ``draft_batch``,
``score_batch``, ``propose_batch``, ``propose_adaptive_batch``); each becomes ONE Ray actor call
(:mod:`actors.protocol`) that also carries the bookkeeping queued since the last call (``rollback`` /
``extend`` / ``release``); the engine sends what is still queued at the end of a step with :meth:`flush`
(outside its lock), so a finished request frees its state on the actor within a step and a hung actor never
stalls the engine's front.  An :class:`Endpoint` is one model actor, or the rank actors of a tensor-parallel
group (every call goes to every rank, in the same order, and rank 0's answer is returned).  Handles of the
drafters hosted by the draft-group actor address their calls to one ``member`` of it.

Not part of the algorithm core: the engine and strategies never import this module.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from actors.protocol import StateLostError, StepCall, expand_onehot, nbytes, unpack
from cluster.core.sampling import SamplingParams
from cluster.errors import ModelUnavailableError

log = logging.getLogger("specserve.remote")
WAIT_SLICE_S = 0.5      # how often a waiting call looks whether the watchdog marked its endpoint down

class Endpoint:
    """One model actor (``len(actors) == 1``) or a lockstep tensor-parallel group, called through Ray.

    A single actor is restarted by Ray (``max_restarts``).  A group cannot take a restarted rank back into its
    ``torch.distributed`` process group, so a group endpoint has a ``rebuild`` (``() -> (actors, placement
    group)``): once the group is down, :meth:`probe` kills every rank and starts a whole new group.

    Once a call found it gone (or the watchdog did, :meth:`mark_down`), calls fail at once with
    :class:`ModelUnavailableError` until :meth:`probe` sees it answer: a dead actor that Ray restarts stays
    pending until some node can host it (its node may be gone for good), and each call would otherwise wait
    ``timeout_s``; the engine's end-of-step releases would stall the step loop that long."""

    def __init__(self, actors: list, *, name: str = "model", timeout_s: float = 300.0, placement_group=None,
                 rebuild: Callable[[], tuple[list, object]] | None = None):
        self.actors, self.timeout_s, self.placement_group = list(actors), timeout_s, placement_group
        self.name = name
        self._submit = threading.Lock()      # every rank must see calls in the same order
        self._probe = None
        self._rebuild = rebuild
        self._rebuilding: threading.Thread | None = None
        self._rebuilt = False
        self.down = False

    def mark_down(self) -> None:
        self.down = True

    def _all(self, method: str, *args):
        """Call ``method`` on every actor; wait up to ``timeout_s``, or until the endpoint is marked down (by
        the watchdog: a call to a dead actor Ray restarts would otherwise wait all of ``timeout_s``)."""
        import ray
        from ray.exceptions import GetTimeoutError
        with self._submit:
            refs = [getattr(a, method).remote(*args) for a in self.actors]
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return ray.get(refs, timeout=max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
            except GetTimeoutError:
                if self.down:
                    raise ModelUnavailableError(self.name, "marked down while a call waited") from None
                if time.monotonic() >= deadline:
                    raise

    def step(self, call: StepCall):
        """-> (result of rank 0, its compute seconds); :class:`ModelUnavailableError` when an actor is gone
        or does not answer within ``timeout_s`` (Ray restarts a dead model actor; see ``probe``)."""
        if self.down:
            raise ModelUnavailableError(self.name, "down until it answers again")
        try:
            return self._step(call)
        except ModelUnavailableError:
            self.down = True
            raise

    def _step(self, call: StepCall):
        from ray.exceptions import (
            ActorUnavailableError,
            GetTimeoutError,
            RayActorError,
            RayTaskError,
        )
        try:
            return self._all("step", call)[0]
        except (RayActorError, ActorUnavailableError) as e:
            raise ModelUnavailableError(self.name, "gone (its actor died)") from e
        except RayTaskError as e:
            if isinstance(e.cause, StateLostError):       # restarted before anyone noticed: state is gone
                raise ModelUnavailableError(self.name, "restarted") from e
            if self._rebuild is not None and not self._all_answer():   # a collective failed: a rank died
                raise ModelUnavailableError(self.name, "a tensor-parallel rank died") from e
            raise
        except GetTimeoutError as e:
            raise ModelUnavailableError(self.name, f"not answering within {self.timeout_s:g}s") from e

    def _all_answer(self, timeout_s: float = 2.0) -> bool:
        import ray
        try:
            ray.get([a.health.remote() for a in self.actors], timeout=timeout_s)
            return True
        except Exception:                                # noqa: BLE001 - dead, restarting or hung
            return False

    def probe(self) -> bool:
        """Non-blocking: True once every actor answers a health call again (after a restart; a group: once
        it has been rebuilt, see the class docstring)."""
        import ray
        if self._rebuild is not None:
            self.down = not self._probe_group()
            return not self.down
        # one snapshot of the pending probe: the coordinator's loop and the engine's step both probe (health.refresh)
        # from their threads, so the other may take the probe (set it to None) between two reads of the attribute
        refs = self._probe
        if refs is None:
            refs = self._probe = [a.health.remote() for a in self.actors]
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
        if self._rebuilding is None:                     # first probe after the group went down
            self._rebuilt = False
            self._rebuilding = threading.Thread(target=self._rebuild_group, daemon=True,
                                                name=f"specserve-rebuild-{self.name}")
            self._rebuilding.start()
            return False
        if self._rebuilding.is_alive():
            return False
        self._rebuilding = None                          # done: a failed attempt is retried at the next probe
        return self._rebuilt

    def _rebuild_group(self) -> None:
        try:
            self.kill()                                  # also unblocks a rank waiting in a collective
            actors, pg = self._rebuild()
            with self._submit:
                self.actors, self.placement_group = list(actors), pg
            self._rebuilt = True
            log.warning("tensor-parallel group %s rebuilt (%d ranks)", self.name, len(actors))
        except Exception:                                # noqa: BLE001 - logged; the next probe tries again
            log.exception("rebuilding tensor-parallel group %s failed", self.name)

    def active_requests(self) -> list[str]:
        return self._all("active_requests")[0]

    def health(self) -> list[dict]:
        return self._all("health")

    def kill(self) -> None:
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


@dataclass
class CallTiming:
    """Totals over a handle's remote calls: the benchmark's RPC vs compute split and bytes moved."""

    calls: int = 0
    wall_s: float = 0.0          # caller-side time of the round trips
    compute_s: float = 0.0       # actor-side time inside the model (rank 0)
    bytes_in: int = 0            # result payload bytes (logits) received

    @property
    def rpc_s(self) -> float:
        return max(0.0, self.wall_s - self.compute_s)


class RemoteHandle:
    """ModelHandle whose model lives in an actor (or TP group); see the module docstring."""

    def __init__(self, endpoint: Endpoint, info: dict, *, placement: str = "actor", member: str | None = None):
        self.endpoint, self.member = endpoint, member
        self.name = info["name"]
        self.vocab_size = int(info["vocab_size"])
        self.max_length = int(info["max_length"])
        self.num_params = int(info["num_params"])
        self.deterministic = bool(info.get("deterministic", False))   # declared by the hosted handle
        self.memory = info.get("memory")      # KV bytes per token, weights, device memory (the KV budget)
        self.placement = placement
        self.tp_size = len(endpoint.actors)
        if info.get("specdec_head") is not None:       # a SpecDec++ drafter's acceptance head
            self.specdec_head = info["specdec_head"]
        self.timing = CallTiming()
        self._ops: list[tuple[str, str, tuple]] = []
        self._lock = threading.Lock()

    # -- bookkeeping: queued, sent with the next call ---------------------------------------------
    def rollback(self, rid: str, length: int) -> None:
        with self._lock:
            self._ops.append(("rollback", rid, (length,)))

    def extend(self, rid: str, ids: list[int]) -> None:
        with self._lock:
            self._ops.append(("extend", rid, (list(ids),)))

    def release(self, rid: str) -> None:
        with self._lock:
            self._ops.append(("release", rid, ()))

    def flush(self) -> None:
        """Send the queued bookkeeping now if it frees a request (a release); rollback / extend alone keep
        riding along with the next call."""
        if any(op == "release" for op, _, _ in self._ops):
            self._call(None, [])

    # -- batched calls: one round trip each ---------------------------------------------------------
    def prefill_batch(self, items: list[tuple[str, list[int], SamplingParams, int]]) -> None:
        self._call("prefill_batch", [(rid, list(ids), s, seed) for rid, ids, s, seed in items])

    def propose_batch(self, items: list[tuple[str, int]]) -> list[tuple[list[int], torch.Tensor]]:
        return self._call("propose_batch", items)

    def score_batch(self, items: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        return self._call("score_batch", items)

    def propose_adaptive_batch(self, items) -> list[tuple[list[int], torch.Tensor]]:
        return self._call("propose_adaptive_batch", items)

    def draft_batch(self, items) -> list:
        """The draft side's blocks (:class:`cluster.core.drafting.DraftBlock`), one round trip for the batch."""
        return self._call("draft_batch", items)

    # -- single-request forms ---------------------------------------------------------------------
    def prefill(self, rid: str, ids: list[int], sampling: SamplingParams, seed: int) -> None:
        self.prefill_batch([(rid, ids, sampling, seed)])

    def propose(self, rid: str, k: int) -> tuple[list[int], torch.Tensor]:
        return self.propose_batch([(rid, k)])[0]

    def score(self, rid: str, draft: list[int]) -> torch.Tensor:
        return self.score_batch([(rid, draft)])[0]

    def propose_adaptive(self, rid: str, k_max: int, head, threshold: float) -> tuple[list[int], torch.Tensor]:
        return self.propose_adaptive_batch([(rid, k_max, head, threshold)])[0]

    def active_requests(self) -> list[str]:
        return self.endpoint.active_requests()

    def probe(self) -> bool:
        return self.endpoint.probe()

    def reset_timing(self) -> None:
        self.timing = CallTiming()

    def _call(self, method: str | None, items: list):
        with self._lock:
            ops, self._ops = self._ops, []
        t0 = time.perf_counter()
        out, compute_s = self.endpoint.step(StepCall(ops, method, items, self.member))
        t = self.timing
        t.calls += 1
        t.wall_s += time.perf_counter() - t0
        t.compute_s += compute_s
        t.bytes_in += nbytes(out)
        out = unpack(out)
        return expand_onehot(method, out, self.vocab_size) if self.deterministic else out
