"""The socket implementation of the transport seam (:class:`cluster.serving.control.channel.Channel`): Ray places,
restarts and health-checks the actor; each per-step call goes over one blocking connection to it.

:class:`SocketChannel` is a :class:`cluster.serving.control.ray_channel.RayChannel` whose ``call`` does not go
through Ray: on first use (and after the connection broke: the actor died and Ray restarted it, or a call timed
out) it asks the actor through Ray to open a socket (:meth:`actors.draft_actor.DraftHost.open_socket`, with a fresh
key) and connects; then a call is one pickled :class:`actors.protocol.StepCall` written and one reply read, both
ends blocking in the kernel while they wait (no core burnt; :mod:`actors.socket_link` says why not a Ray call
for this hop).  ``ask`` (info, health, active requests), ``probe`` and ``close`` stay Ray's, so the coordinator's
watchdog, restarts and failure handling are those of :class:`RayChannel`: a broken connection or a call not
answered within ``timeout_s`` marks the channel down (:class:`cluster.errors.ModelUnavailableError`) until a probe
sees the actor answer again; the next call then reconnects.  Chosen by ``cluster.draft_channel: socket`` for the
draft-group actor (one actor; a tensor-parallel group stays on Ray).
"""
from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Client

from actors.protocol import StateLostError, StepCall
from cluster.errors import ModelUnavailableError
from cluster.serving.control.ray_channel import WAIT_SLICE_S, RayChannel


class SocketChannel(RayChannel):
    """See the module docstring.  One actor (the draft group's)."""

    def __init__(self, actors: list, **options):
        if len(actors) != 1 or options.get("restart") is not None:
            raise ValueError("a socket channel carries one actor's calls (a tensor-parallel group stays on Ray)")
        super().__init__(actors, **options)
        self._conn = None
        self._link = threading.Lock()          # one call at a time on the connection
        self.connects = 0                      # connections made (the first, then one per reconnect)

    def _call(self, step: StepCall):
        with self._link:
            conn = self._conn if self._conn is not None else self._connect()
            try:
                conn.send(step)
                self._await(conn)
                reply = conn.recv()
            except (EOFError, OSError) as e:
                self._drop()
                raise ModelUnavailableError(self.name, "gone (its connection closed)") from e
        ok, value, extra = reply
        if ok:
            return value, extra
        if extra:
            value.add_note("on the model's side:\n" + extra)
        if isinstance(value, StateLostError):   # restarted before anyone noticed: state is gone
            raise ModelUnavailableError(self.name, "restarted") from value
        raise value

    def _await(self, conn) -> None:
        """Block until the reply is readable; give up (dropping the connection: a late reply must not be read as
        the next call's) when the watchdog marks the channel down or ``timeout_s`` passes."""
        deadline = time.monotonic() + self.timeout_s
        while not conn.poll(max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic()))):
            if self.down or time.monotonic() >= deadline:
                self._drop()
                why = "marked down while a call waited" if self.down else f"not answering within {self.timeout_s:g}s"
                raise ModelUnavailableError(self.name, why)

    def _connect(self):
        """Ask the actor (through Ray) for a fresh socket and connect to it."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
        key = os.urandom(32)
        try:
            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
            address, family = ray.get(self.actors[0].open_socket.remote(node, key), timeout=self.timeout_s)
            self._conn = Client(address, family=family, authkey=key)
        except (RayActorError, ActorUnavailableError, GetTimeoutError, RayTaskError, OSError) as e:
            raise ModelUnavailableError(self.name, "its socket could not be opened") from e
        self.connects += 1
        return self._conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        close_quietly(conn)

    def close(self) -> None:
        self._drop()
        super().close()


def close_quietly(conn) -> None:
    """Close a connection (None: nothing) that may already be broken."""
    if conn is not None:
        try:
            conn.close()
        except OSError:
            pass
