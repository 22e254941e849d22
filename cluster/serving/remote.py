"""A :class:`cluster.core.interfaces.ModelHandle` over Ray actors, so the unchanged engine drives remote models.

Calls that return nothing (``prefill``, ``rollback``, ``extend``) are queued per request and sent
with the next ``propose`` / ``score``: one round trip per model per decoding step.  A handle wraps an
:class:`Endpoint`: one model actor, or the rank actors of a tensor-parallel group (every call goes
to every rank, in the same order, and rank 0's answer is returned).

Not part of the algorithm core: the engine and strategies never import this module.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client

import torch

from actors.protocol import tcp_nodelay, unpack
from cluster.core.sampling import SamplingParams


class Endpoint:
    """One model actor (``len(actors) == 1``) or a lockstep tensor-parallel group.

    ``direct=True`` sends ``call`` / ``release`` over the actors' direct sockets
    (:meth:`actors.model_actor.ModelHost.serve_direct`; one connection per caller thread, or one shared
    connection per rank for a TP group, used under a lock so every rank sees the same order);
    otherwise as Ray actor tasks.  Ray always carries the rest (info, health, active_requests).
    """

    def __init__(self, actors: list, *, timeout_s: float = 300.0, placement_group=None, direct: bool = True):
        import ray
        self.actors, self.timeout_s, self.placement_group = list(actors), timeout_s, placement_group
        self._submit = threading.Lock()      # every rank must see calls in the same order
        self._addrs = ray.get([a.serve_direct.remote() for a in self.actors], timeout=timeout_s) \
            if direct else None
        self._local = threading.local()
        self._shared = None                  # TP: one connection per rank

    @property
    def direct(self) -> bool:
        return self._addrs is not None

    def _ray_all(self, method: str, *args):
        import ray
        with self._submit:
            refs = [getattr(a, method).remote(*args) for a in self.actors]
        return ray.get(refs, timeout=self.timeout_s)

    def _connect(self) -> list:
        return [tcp_nodelay(Client((host, port), authkey=key)) for host, port, key in self._addrs]

    def _direct_all(self, method: str, *args):
        msg = (method, args)
        if len(self.actors) == 1:
            conns = getattr(self._local, "conns", None)
            if conns is None:
                conns = self._local.conns = self._connect()
            try:
                conns[0].send(msg)
                return [self._reply(conns[0])]
            except (TimeoutError, EOFError, OSError):
                self._local.conns = None          # out of step: reconnect next time
                raise
        with self._submit:
            if self._shared is None:
                self._shared = self._connect()
            try:
                for c in self._shared:
                    c.send(msg)
                return [self._reply(c) for c in self._shared]
            except (TimeoutError, EOFError, OSError):
                self._shared = None
                raise

    def _reply(self, conn):
        if not conn.poll(self.timeout_s):
            raise TimeoutError(f"model call took longer than {self.timeout_s}s")
        status, out = conn.recv()
        if status == "err":
            raise out
        return out

    def call(self, rid: str, ops: list, method: str, args: tuple):
        """-> (result of rank 0, its compute seconds)."""
        if self.direct:
            return self._direct_all("call", rid, ops, method, args)[0]
        return self._ray_all("call", rid, ops, method, args)[0]

    def release(self, rid: str) -> None:
        if self.direct:
            self._direct_all("release", rid)
        else:
            self._ray_all("release", rid)

    def active_requests(self) -> list[str]:
        return self._ray_all("active_requests")[0]

    def health(self) -> list[dict]:
        return self._ray_all("health")

    def kill(self) -> None:
        import ray
        for c in self._shared or []:
            c.close()
        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.placement_group)


@dataclass
class CallTiming:
    """Totals over a handle's remote calls: the benchmark's RPC vs compute split."""

    calls: int = 0
    wall_s: float = 0.0          # caller-side time of the round trips
    compute_s: float = 0.0       # actor-side time inside the model (rank 0)

    @property
    def rpc_s(self) -> float:
        return max(0.0, self.wall_s - self.compute_s)


class RemoteHandle:
    """ModelHandle whose model lives in an actor (or TP group); see the module docstring."""

    def __init__(self, endpoint: Endpoint, info: dict, *, placement: str = "actor"):
        self.endpoint = endpoint
        self.name = info["name"]
        self.vocab_size = int(info["vocab_size"])
        self.max_length = int(info["max_length"])
        self.num_params = int(info["num_params"])
        self.placement = placement
        self.tp_size = len(endpoint.actors)
        self.deterministic = bool(info.get("deterministic", False))   # declared by the hosted handle
        if info.get("specdec_head") is not None:       # a SpecDec++ drafter's acceptance head
            self.specdec_head = info["specdec_head"]
        self.timing = CallTiming()
        self._pending: dict[str, list] = {}
        self._lock = threading.Lock()

    # -- queued (no result) ---------------------------------------------------------------------
    def prefill(self, rid: str, ids: list[int], sampling: SamplingParams, seed: int) -> None:
        with self._lock:
            self._pending[rid] = [("prefill", (list(ids), sampling, int(seed)))]

    def rollback(self, rid: str, length: int) -> None:
        self._queue(rid, ("rollback", (int(length),)))

    def extend(self, rid: str, ids: list[int]) -> None:
        if ids:
            self._queue(rid, ("extend", (list(ids),)))

    # -- one round trip ---------------------------------------------------------------------------
    def propose(self, rid: str, k: int) -> tuple[list[int], torch.Tensor]:
        tokens, logits = self._call(rid, "propose", (int(k),))
        return list(tokens), logits                                    # [k], [k, V]

    def score(self, rid: str, draft: list[int]) -> torch.Tensor:
        return self._call(rid, "score", (list(draft),))                # [L+1, V]

    def propose_adaptive(self, rid: str, k_max: int, head, threshold: float) -> tuple[list[int], torch.Tensor]:
        """SpecDec++ drafting on the actor (``head`` must be picklable, e.g. its directory)."""
        tokens, logits = self._call(rid, "propose_adaptive", (int(k_max), head, float(threshold)))
        return list(tokens), logits                                    # [K], [K, V]

    def release(self, rid: str) -> None:
        with self._lock:
            self._pending.pop(rid, None)
        self.endpoint.release(rid)

    # -- introspection ----------------------------------------------------------------------------
    def active_requests(self) -> list[str]:
        return self.endpoint.active_requests()

    def reset_timing(self) -> None:
        self.timing = CallTiming()

    # -- internals --------------------------------------------------------------------------------
    def _queue(self, rid: str, op) -> None:
        with self._lock:
            ops = self._pending.setdefault(rid, [])
            if op[0] == "rollback" and ops and ops[-1][0] == "rollback":
                ops[-1] = op                  # consecutive truncations: the last one wins
            else:
                ops.append(op)

    def _call(self, rid: str, method: str, args: tuple):
        with self._lock:
            ops = self._pending.pop(rid, [])
        t0 = time.perf_counter()
        out, compute = self.endpoint.call(rid, ops, method, args)
        t = self.timing
        t.calls += 1
        t.wall_s += time.perf_counter() - t0
        t.compute_s += compute
        return unpack(out)
