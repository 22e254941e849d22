"""The far speculator's end of its link (the ``speculator`` topology, :mod:`cluster.core.draft.near_far`): the
draft-group actor hosts a :class:`cluster.core.draft.speculator.Speculator` over its own copy of the drafters and
answers the coordinator's fills on a socket of their own.

A fill arrives while the coordinator's target verifies; the speculator drafts every branch and writes its
:class:`cluster.core.draft.speculator.Reply`.  It gives up between drafting rounds as soon as the next message is
readable (a newer fill: the coordinator has moved on, the answer could only be late), answering with what it has,
so every fill gets exactly one reply, in order.  The connection is the standard library's
``multiprocessing.connection`` as in :mod:`actors.socket_link` (why a socket and not a Ray call: see there); both
ends block in the kernel while idle.  The coordinator never waits for a reply: it reads the ones that have
arrived when its next step starts (:class:`cluster.serving.control.speculator_link.SocketSpeculatorLink`).  The
speculator's thread runs nicer than its process (``NICER``): it takes a spare core, not the coordinator's.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from actors.socket_link import SocketServer
from cluster.core.draft.speculator import Reply, Speculator

log = logging.getLogger("specserve.speculator")

# The speculator's thread runs this much nicer than its process (Ray starts workers at nice 15, the coordinator's
# Serve replica too; at most 19): it drafts on a spare core, and where there is none (the machine's cores are
# shared with other work) the scheduler serves the coordinator's verification and near drafting first -- the
# speculator then answers late, the near side backs off, and the unit keeps colocated speed
NICER = 4


class SpeculatorServer(SocketServer):
    """Answers fills on one connection with ``speculator`` (see the module docstring)."""

    def __init__(self, speculator: Speculator, *, same_node: bool, authkey: bytes):
        self.speculator = speculator
        self.fills = self.given_up = 0
        super().__init__(None, same_node=same_node, authkey=authkey)

    def _loop(self, conn) -> None:
        _lower_priority(NICER)
        early = []                               # a fill that came while drafting ahead, as predicted
        while True:
            try:
                fill = early.pop() if early else conn.recv()
            except (EOFError, OSError):
                break
            newer = []

            def stop() -> bool:
                if not newer and conn.poll():
                    newer.append(True)
                return bool(newer)
            t0 = time.perf_counter()
            try:
                reply = self.speculator.fill(fill, stop=stop)
            except Exception:                    # noqa: BLE001 - a failed fill only loses its head start
                log.exception("speculator fill %s failed", fill.id)
                reply = Reply(fill.id, {})
            reply.compute_s = time.perf_counter() - t0
            self.fills += 1
            self.given_up += bool(newer)
            try:
                conn.send(reply)
            except (OSError, ValueError):
                break
            if not newer:                        # until the next fill: draft it ahead on the likeliest outcome
                try:
                    self.speculator.ahead(stop=lambda: self._ahead_stop(conn, early))
                except (EOFError, OSError):
                    break
                except Exception:                # noqa: BLE001 - a failed look-ahead only loses its head start
                    log.exception("speculator look-ahead after fill %s failed", fill.id)

    def _ahead_stop(self, conn, early: list) -> bool:
        """Asked between the look-ahead's drafting rounds: go on while no fill came, or the one that came asks
        exactly what is being drafted (it is answered from it once done); give up for any other."""
        if not early:
            if not conn.poll():
                return False
            early.append(conn.recv())
        return not self.speculator.predicted(early[0])


def _lower_priority(more: int) -> None:
    """This thread ``more`` nicer, up to 19 (Linux: nice is per thread; raising it needs no privilege); nothing
    where it cannot."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + more))
    except (AttributeError, OSError):
        pass
