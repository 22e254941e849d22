"""The coordinator's end of the far speculator's link (the ``speculator`` topology): a
:class:`cluster.core.draft.near_far.SpeculatorLink` over one socket to the draft-group actor.

Ray places, restarts and health-checks the actor, and hands out the socket (:meth:`actors.draft_actor.DraftHost.
open_speculator`, with a fresh key, as the socket channel does); fills and replies then travel as pickles over the
connection (:mod:`actors.speculator_host`).  Nothing here ever waits on the speculator: ``send`` writes one message
(a fill of a few hundred bytes: the kernel buffers it), ``poll`` reads only the replies already readable, and
connecting is asynchronous -- the Ray call that opens the socket is started by one ``poll`` and looked at by the
next ones (``ray.wait`` with no timeout).  A broken connection (the actor died) takes the link down: the near
drafter answers every step (colocated speed) while the link asks the restarted actor for a new socket, at most
every ``RETRY_S``.
"""
from __future__ import annotations

import logging
import os
import pickle
import select
import time
from multiprocessing.connection import Client

from cluster.core.draft.near_far import SpeculatorLink
from cluster.core.draft.speculator import Fill, Reply
from cluster.serving.control.socket_channel import close_quietly

log = logging.getLogger("specserve.speculator")

RETRY_S = 1.0


class SocketSpeculatorLink(SpeculatorLink):
    """See the module docstring.  ``actor``: the draft-group actor (its handle)."""

    def __init__(self, actor):
        self.actor = actor
        self._conn = None
        self._opening = None                  # (ObjectRef of open_speculator, key) while a socket is being opened
        self._next_try = 0.0
        self.connects = 0

    def open(self, timeout_s: float) -> bool:
        """Connect now, waiting up to ``timeout_s`` (at startup, once the actor has loaded); True once up."""
        import ray
        self._next_try = 0.0
        self._connect()
        if self._opening is not None:
            ray.wait([self._opening[0]], timeout=timeout_s)
            self._connect()
        return self.up

    @property
    def up(self) -> bool:
        return self._conn is not None

    def send(self, fill: Fill) -> bool:
        if self._conn is None:
            return False
        try:
            payload = pickle.dumps(fill, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:                 # noqa: BLE001 - this fill does not travel; the step drafts near
            log.warning("a speculator fill could not be pickled: %s", type(e).__name__)
            return False
        try:
            self._conn.send_bytes(payload)
            return True
        except (OSError, ValueError):
            self._drop("its connection closed")
            return False

    def poll(self) -> list[Reply]:
        if self._conn is None:
            self._connect()
            return []
        out = []
        try:
            while select.select([self._conn], [], [], 0)[0]:     # one syscall (Connection.poll builds a selector)
                out.append(self._conn.recv())
        except (EOFError, OSError, ValueError):
            self._drop("its connection closed")
        return out

    def _connect(self) -> None:
        """One non-blocking step of opening the socket (see the module docstring)."""
        import ray
        if self._opening is None:
            if time.monotonic() < self._next_try:
                return
            key = os.urandom(32)
            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
            self._opening = (self.actor.open_speculator.remote(node, key), key)
            return
        ref, key = self._opening
        if not ray.wait([ref], timeout=0)[0]:
            return
        self._opening = None
        try:
            address, family = ray.get(ref)
            self._conn = Client(address, family=family, authkey=key)
            self.connects += 1
        except Exception as e:                 # noqa: BLE001 - dead or restarting: the near drafter goes on
            self._drop(f"its socket could not be opened ({type(e).__name__})")

    def _drop(self, why: str) -> None:
        conn, self._conn = self._conn, None
        self._next_try = time.monotonic() + RETRY_S
        log.warning("speculator link down: %s; drafting near until it is back", why)
        close_quietly(conn)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        close_quietly(conn)
