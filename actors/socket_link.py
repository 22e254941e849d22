"""The host's end of the socket channel (:class:`cluster.serving.control.socket_channel.SocketChannel`): per-step
calls over one blocking connection instead of Ray actor calls.

Why not a Ray actor call for this hop: a Ray call goes from the caller's core worker to the actor's task queue
and back through the owner's reply path -- a fixed cost many times that of a pickled block over a local socket
(``specserve bench --suite served --channels ray,socket`` runs both side by side), paid
once per step on the critical path -- and Ray serialises the reply only after the method returns, while the
pre-draft thread the draft host starts then competes for the GIL.  A Ray Compiled Graph answers fast but both of
its ends poll a core while they wait.  Here both ends block in the kernel (``recv``), burning nothing, and the
host starts its after-reply work (pre-drafting) once the reply has been written.  Ray still places, restarts and
health-checks the actor, and hands out the address (:meth:`actors.draft_actor.DraftHost.open_socket`).

Framing and authentication are the standard library's ``multiprocessing.connection`` (length-prefixed pickles;
an HMAC challenge with a per-connection key the caller sent through Ray).  A Unix socket in a private temporary
directory when both ends share a node, TCP on the node's address otherwise.  One connection at a time: a new
one (the caller reconnecting after a timeout) replaces the last.

Each message from the caller is a :class:`actors.protocol.StepCall`; each reply is ``(True, result, StepTime)``
or ``(False, exception, remote traceback text)``.
"""
from __future__ import annotations

import logging
import os
import pickle
import shutil
import socket
import tempfile
import threading
import traceback
from multiprocessing.connection import Listener

log = logging.getLogger("specserve.socket")


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (it is re-raised on the caller's side), else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:                            # noqa: BLE001 - an exception type pickle cannot rebuild
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class SocketServer:
    """Accepts the caller's connection and answers its calls through ``host.answer`` (then ``host.after_reply``),
    in one daemon thread.  ``same_node``: a Unix socket, else TCP on this node's address."""

    def __init__(self, host, *, same_node: bool, authkey: bytes):
        self.host = host
        self._dir = None
        if same_node:
            self._dir = tempfile.mkdtemp(prefix="specserve-")
            self.family, address = "AF_UNIX", os.path.join(self._dir, "step.sock")
        else:
            self.family, address = "AF_INET", (_node_address(), 0)
        self._listener = Listener(address, family=self.family, authkey=authkey)
        self.address = self._listener.address
        self._conn = None
        self._closed = False
        threading.Thread(target=self._serve, daemon=True, name="specserve-socket").start()

    def _serve(self) -> None:
        try:
            conn = self._listener.accept()
        except Exception:                        # noqa: BLE001 - closed before the caller connected, or a bad key
            return
        if self._closed:
            conn.close()
            return
        self._conn = conn
        self._loop(conn)
        conn.close()

    def _loop(self, conn) -> None:
        """Answer the caller's calls until it closes the connection."""
        while True:
            try:
                call = conn.recv()
            except (EOFError, OSError):          # the caller closed it (or this end was closed)
                break
            try:
                reply = (True, *self.host.answer(call))
            except Exception as e:               # noqa: BLE001 - travels back and is raised there
                reply = (False, portable(e), traceback.format_exc())
            try:
                conn.send(reply)
            except (OSError, ValueError):
                break
            self.host.after_reply()              # the reply has left: pre-drafting takes the GIL only now

    def close(self) -> None:
        self._closed = True
        for thing in (self._conn, self._listener):
            try:
                if thing is not None:
                    thing.close()
            except OSError:
                pass
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _node_address() -> str:
    """This node's address as Ray knows it (other nodes reach it there); loopback outside Ray."""
    try:
        import ray
        return ray.util.get_node_ip_address()
    except Exception:                            # noqa: BLE001 - not in a Ray worker
        return socket.gethostbyname("localhost")
