"""The draft-group actor: every drafter of a serving unit (and the Max-Gram drafter) in one Ray actor, behind
the draft side (:class:`cluster.core.draft.side.DraftSide`).

Why one actor for all drafters (docs/operator-guide.md, "Topologies"): a CS Drafting step makes several dependent
drafter calls (a larger drafter reviews what the smaller ones and Max-Gram drafted); with one actor per
drafter each would be a round trip from the coordinator, several per target forward.
Here they are in-process calls, and the coordinator pays ONE round trip per step for the whole block,
whatever the cascade's depth.  Drafters are small: they fit one process (on GPUs: one device) together.

Overlap: after answering a ``draft_batch`` call, the actor pre-drafts every request's next block in a
background thread (:meth:`DraftSide.predraft`) while the coordinator's target verifies the block it just
got; the next call waits for that thread first, so the draft side's state is only ever touched by one
thread at a time -- unless the call's bookkeeping shows that no block being drafted can be used (a rejection:
:meth:`DraftSide.could_use`), when it tells the thread to give up at its next drafting round and waits only
for that.  Through a Ray actor call (:meth:`DraftHost.step`) the thread starts before Ray serialises
and sends the reply (Ray does that after the method returns), so the two share the GIL; through the socket
channel (:meth:`DraftHost.open_socket`, :mod:`actors.socket_link`) it starts after the reply has left.
Calls addressed to one drafter (``StepCall.member``: strategies that drive a drafter
directly, e.g. speculative cascades) run on that drafter's handle.
"""
from __future__ import annotations

import threading


from actors.model_actor import MAX_RESTARTS
from actors.protocol import StepCall, StepTime, apply, stamp
from actors.socket_link import SocketServer
from actors.speculator_host import SpeculatorServer
from cluster.core.draft.side import DraftSide
from cluster.core.draft.speculator import Speculator
from cluster.models.build import build_handle
from cluster.models.host import setup_process


class DraftHost:
    """The actor body: builds the unit's drafters (``names``; the statistical ones with the target's vocabulary)."""

    def __init__(self, cfg, names: list[str], vocab_size: int | None = None, threads: int = 1,
                 overlap: bool = True):
        setup_process(threads)
        members = {n: build_handle(cfg, n) for n in names}
        for name in cfg.statistical:            # the target's vocabulary (= every drafter's; None: theirs)
            vocab = vocab_size or min(h.vocab_size for h in members.values())
            members[name] = build_handle(cfg, name, vocab_size=vocab)
        self.side = DraftSide(members, overlap=overlap, deferred=True)
        self._predraft: threading.Thread | None = None
        self.predraft_s = self.wait_s = 0.0     # background seconds pre-drafting; calls' seconds waiting on it
        self._socket: SocketServer | None = None
        self._give_up = threading.Event()
        self.given_up = 0                       # pre-drafts told to give up (the call showed a rejection)
        self._speculator: SpeculatorServer | None = None

    def info(self) -> dict:
        return dict(self.side.capabilities(), members={n: h.capabilities() for n, h in self.side.members.items()})

    def step(self, call: StepCall):
        """A Ray actor call: -> (packed result, :class:`actors.protocol.StepTime`); pre-drafting of the answered
        block starts before Ray sends the reply (see the module docstring)."""
        out = self.answer(call)
        self.after_reply()
        return out

    def answer(self, call: StepCall):
        """-> (packed result, StepTime): waiting for the last pre-draft (``wait_s``) is not compute."""
        t0 = stamp()
        if self._predraft is not None and call.member is None and not self.side.could_use(call.ops):
            self._give_up.set()                 # no block being drafted can be used: stop at the next round
            self.given_up += 1
        self._join()
        self._give_up.clear()
        t1 = stamp()
        hits, misses = self.side.hits, self.side.misses
        handle = self.side if call.member is None else self.side.members[call.member]
        out = apply(handle, call)
        t2 = stamp()
        return out, StepTime(t2 - t1, t0, t2, t1 - t0, self.side.hits - hits, self.side.misses - misses)

    def after_reply(self) -> None:
        """Start pre-drafting the blocks just answered (if any), in a background thread."""
        if self.side.pending:
            self._predraft = threading.Thread(target=self._run_predraft, daemon=True, name="specserve-predraft")
            self._predraft.start()

    def open_socket(self, node_id: str | None, authkey: bytes):
        """Serve per-step calls on a fresh socket (:mod:`actors.socket_link`; the one before is closed): a Unix
        socket when the caller runs on this node (``node_id``), TCP on this node's address otherwise.  Returns
        ``(address, family)`` for ``multiprocessing.connection.Client``."""
        if self._socket is not None:
            self._socket.close()
        self._socket = SocketServer(self, same_node=node_id == _node_id(), authkey=authkey)
        return self._socket.address, self._socket.family

    def open_speculator(self, node_id: str | None, authkey: bytes):
        """Host the far speculator (the ``speculator`` topology): its fills answered on a fresh socket
        (:mod:`actors.speculator_host`), by a speculator over this actor's drafters; ``(address, family)``."""
        old = self._speculator
        if old is not None:
            old.close()
        spec = old.speculator if old is not None else Speculator(self.side.members)
        self._speculator = SpeculatorServer(spec, same_node=node_id == _node_id(), authkey=authkey)
        return self._speculator.address, self._speculator.family

    def _run_predraft(self) -> None:
        t0 = stamp()
        try:
            self.side.predraft(stop=self._give_up.is_set)
        except Exception:                       # noqa: BLE001 - a failed pre-draft only loses its head start
            pass
        self.predraft_s += stamp() - t0

    def _join(self) -> None:
        if self._predraft is not None:
            t0 = stamp()
            self._predraft.join()
            self._predraft = None
            self.wait_s += stamp() - t0

    def stats(self) -> dict:
        """Pre-drafted blocks used / dropped, and background seconds (the benchmark reads them)."""
        spec = self._speculator
        return dict(hits=self.side.hits, misses=self.side.misses, predraft_s=self.predraft_s, wait_s=self.wait_s,
                    given_up=self.given_up, fills=spec.fills if spec else 0, fills_given_up=spec.given_up if spec else 0)

    def active_requests(self) -> list[str]:
        return self.side.active_requests()

    def cache_info(self) -> dict:
        return self.side.cache_info()

    def health(self) -> dict:
        return dict(name=self.side.name, ok=True, active=len(self.side.active_requests()))


def _node_id() -> str | None:
    try:
        import ray
        return ray.get_runtime_context().get_node_id()
    except Exception:                           # noqa: BLE001 - not in a Ray worker (tests host it in-process)
        return None


def start_draft_actor(cfg, names: list[str], vocab_size: int, *, num_cpus: float, num_gpus: float = 0.0,
                      threads: int = 1, overlap: bool = True, **options):
    """Create the unit's draft-group actor; returns the handle (not yet waited on).  ``options``: more Ray actor
    options (placement: ``resources``, ``label_selector``)."""
    import ray
    return ray.remote(DraftHost).options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=2,
                                         max_restarts=MAX_RESTARTS, **options).remote(cfg, names, vocab_size,
                                                                                      threads, overlap)
