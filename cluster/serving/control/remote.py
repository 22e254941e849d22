"""A :class:`cluster.core.interfaces.BatchedHandle` over a channel, so the unchanged engine drives remote models.

The engine calls the batched forms once per step and model (``prefill_batch``, ``draft_batch``,
``score_batch``, ``propose_batch``, ``propose_adaptive_batch``); each becomes ONE call on the handle's
:class:`cluster.serving.control.channel.Channel` (:mod:`actors.protocol`'s ``StepCall``; a Ray actor call through
:class:`cluster.serving.control.ray_channel.RayChannel`) that also carries the bookkeeping queued since the last call
(``rollback`` / ``extend`` / ``release``); the engine sends what is still queued at the end of a step with
:meth:`flush` (outside its lock), so a finished request frees its state on the actor within a step and a hung
actor never stalls the engine's front.  Handles of the drafters hosted by the draft-group actor address their
calls to one ``member`` of it.

Not part of the algorithm core: the engine and strategies never import this module.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from actors.protocol import StepCall, StepTime, expand_onehot, nbytes, stamp, unpack
from cluster.core.calls import PrefillItem
from cluster.core.interfaces import BatchedHandle
from cluster.core.sampling import Rng
from cluster.serving.control.channel import Channel


@dataclass
class CallTiming:
    """Totals over a handle's remote calls: the benchmark's RPC vs compute split, bytes moved, and each call's hops
    (:class:`actors.protocol.StepTime`'s stamps against the caller's: one clock per host, see ``stamp``)."""

    calls: int = 0
    wall_s: float = 0.0          # caller-side time of the round trips (sent -> received)
    compute_s: float = 0.0       # actor-side time inside the model (rank 0)
    bytes_in: int = 0            # result payload bytes (logits) received
    request_s: float = 0.0       # sent -> the actor's entry (serialising, the transport, deserialising)
    actor_s: float = 0.0         # the actor's entry -> exit: its wait + compute (+ its own bookkeeping)
    reply_s: float = 0.0         # the actor's exit -> received
    wait_s: float = 0.0          # the actor waiting for its own pre-draft before computing
    hits: int = 0                # pre-drafted blocks used / dropped (the draft side)
    misses: int = 0
    hit_calls: int = 0           # calls that used a pre-drafted block, and their compute
    hit_compute_s: float = 0.0
    disordered: int = 0          # calls whose stamps were not sent <= entry <= exit <= received (clocks differ)

    @property
    def rpc_s(self) -> float:
        return max(0.0, self.wall_s - self.compute_s)

    def add(self, sent: float, received: float, st: StepTime, nbytes_in: int) -> None:
        self.calls += 1
        self.wall_s += received - sent
        self.compute_s += st.compute_s
        self.bytes_in += nbytes_in
        if st.entry:
            self.request_s += st.entry - sent
            self.actor_s += st.exit - st.entry
            self.reply_s += received - st.exit
            self.disordered += not sent <= st.entry <= st.exit <= received
        self.wait_s += st.wait_s
        self.hits += st.hits
        self.misses += st.misses
        if st.hits:
            self.hit_calls += 1
            self.hit_compute_s += st.compute_s


class RemoteHandle(BatchedHandle):
    """BatchedHandle whose model lives in an actor (or TP group); see the module docstring.  ``info``: the
    hosted handle's :meth:`cluster.core.interfaces.BatchedHandle.capabilities`, which it declares as its own."""

    def __init__(self, channel: Channel, info: dict, *, placement: str = "actor", member: str | None = None):
        self.channel, self.member = channel, member
        self.name = info["name"]
        self.vocab_size = int(info["vocab_size"])
        self.max_length = int(info["max_length"])
        self.num_params = int(info["num_params"])
        self.deterministic, self.proposes = bool(info["deterministic"]), bool(info["proposes"])
        self.statistical = info.get("statistical")
        self.adaptive, self.specdec_head = bool(info["adaptive"]), info["specdec_head"]
        self.memory = info["memory"]          # KV bytes per token, weights, device memory (the KV budget)
        self.placement = placement
        self.tp_size = channel.ranks
        self.timing = CallTiming()
        self.per_method: dict[str, CallTiming] = {}    # the same, per batched method (None: bookkeeping only)
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
    def prefill_batch(self, items: list[tuple]) -> list[int] | None:
        """Items travel as :class:`cluster.core.calls.PrefillItem` (4-tuples read as unsalted); -> the hosted
        handle's answer (the prefix cache's hits)."""
        return self._call("prefill_batch", [PrefillItem.of(it)._replace(ids=list(it[1])) for it in items])

    def propose_batch(self, items: list[tuple[str, int]]) -> list[tuple[list[int], torch.Tensor]]:
        return self._call("propose_batch", items)

    def score_batch(self, items: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        return self._call("score_batch", items)

    def propose_adaptive_batch(self, items) -> list[tuple[list[int], torch.Tensor]]:
        return self._call("propose_adaptive_batch", items)

    def draft_batch(self, items) -> list:
        """The draft side's blocks (:class:`cluster.core.draft.programs.DraftBlock`), one round trip for the batch."""
        return self._call("draft_batch", items)

    def verify_batch(self, items) -> list:
        """The round verified where the target runs: items travel with the request's seed for the counter-based
        draws, token ids come back (a branching test source verifies here, over ``score_batch``'s rows)."""
        if not all(type(it.rng) is Rng for it in items):
            return super().verify_batch(items)
        return self._call("verify_batch", [it._replace(rng=it.rng.seed) for it in items])

    def active_requests(self) -> list[str]:
        return self.channel.ask("active_requests").wait(self.channel.timeout_s)[0]

    def cache_info(self) -> dict:
        """Rank 0's answer; a draft group member's part of the group's."""
        info = self.channel.ask("cache_info").wait(self.channel.timeout_s)[0]
        return info.get("members", {}).get(self.member, {}) if self.member else info

    def probe(self) -> bool:
        return self.channel.probe()

    def reset_timing(self) -> None:
        self.timing = CallTiming()
        self.per_method = {}

    def _call(self, method: str | None, items: list):
        with self._lock:
            ops, self._ops = self._ops, []
        sent = stamp()
        out, st = self.channel.call(StepCall(ops, method, items, self.member))
        received, size = stamp(), nbytes(out)
        self.timing.add(sent, received, st, size)
        self.per_method.setdefault(method, CallTiming()).add(sent, received, st, size)
        out = unpack(out)
        return expand_onehot(method, out, self.vocab_size, items) if self.deterministic else out
