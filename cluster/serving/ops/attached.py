"""An attached ``specserve up`` and the ``specserve down`` that stops it: one owner for every shutdown step
(docs/operator-guide.md, "One machine").

An attached ``up`` (no ``--detach``) stays in the foreground as a Ray driver and, unless it joined a cluster with
``--address``, as the owner of the Ray head it started.  Stopping it is four steps, each needing the ones before
it done: delete the application, shut Serve down (controller, proxies, replicas), disconnect the drivers
(``ray.shutdown``), stop the head.  They used to be split: ``down`` deleted the app and shut Serve down while
``up``, polling ``serve.status()``, saw its app gone and stopped its head, so ``down`` sat inside
``serve.shutdown`` talking to a dead GCS until Ray's 60 s reconnection timeout, or ``up`` died with a traceback
on a status call to the controller ``down`` had just killed.  Now the attached ``up`` owns all four steps
(:func:`shut_down`): it records itself (:func:`save_attached`) beside Ray's token, where every ``down`` that can
authenticate to its loopback head looks, and ``down`` finding that record only sends it SIGTERM and waits for
its process to end (:func:`stop_attached`).  Ctrl-C on ``up`` runs the same steps, so ``down`` and Ctrl-C in
either order end the same way.

The rest is a fallback for a driver that did not ask (``serve delete``/``serve shutdown``, a ``down`` with
another token directory): ``up`` then waits, bounded and polled on Serve's state, for that driver's Serve
shutdown to finish killing the controller before it stops its head (:func:`wait_serve_gone`).  Only the
driver's own ``ray.shutdown`` after that is not waited for (Ray tells no other driver when it disconnects).

Ray and Serve are imported inside the functions that use them: ``use_token`` must set Ray's environment first.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from cluster.errors import ParamError
from cluster.serving.ops.ray_node import RayNode, is_loopback, token_file

POLL_S = 1.0                 # how often an attached `up` checks that its application is still served
EXTERNAL_SHUTDOWN_S = 30.0   # fallback: how long `up` lets another driver's serve.shutdown finish
STOP = threading.Event()     # set by Ctrl-C or SIGTERM (:func:`interrupt_on_stop`), whatever became of the exception


@dataclass(frozen=True)
class AttachedUp:
    """A running attached ``specserve up``: its process (PID and start time, so a reused PID is not it), the GCS
    it is a driver of, its application and the Ray head it started (None: it joined with ``--address``)."""

    pid: int
    create_time: float
    address: str
    app: str
    head_pid: int | None

    def alive(self) -> bool:
        try:
            return psutil.Process(self.pid).create_time() == self.create_time
        except psutil.NoSuchProcess:
            return False


def attached_file(address: str) -> Path:
    """Where the attached ``up`` driving the GCS at ``address`` records itself (beside the token, 0600)."""
    return token_file().parent / f"specserve-up-{address.replace(':', '-')}.json"


def save_attached(address: str, app: str, head: RayNode | None) -> AttachedUp:
    up = AttachedUp(os.getpid(), psutil.Process().create_time(), address, app, head.pid if head else None)
    fd = os.open(attached_file(address), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(up), f)
    return up


def clear_attached(up: AttachedUp | None) -> None:
    if up is not None:
        attached_file(up.address).unlink(missing_ok=True)


def _same_gcs(a: str, b: str) -> bool:
    return a == b or (is_loopback(a) and is_loopback(b) and a.rsplit(":", 1)[-1] == b.rsplit(":", 1)[-1])


def find_attached(address: str | None) -> AttachedUp | None:
    """The live attached ``up`` driving ``address`` (None or ``auto``: the only one there is); records of
    processes that are gone are removed.  Several and no address: a ParamError naming them."""
    live = []
    for path in sorted(token_file().parent.glob("specserve-up-*.json")):
        try:
            up = AttachedUp(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if not up.alive():
            path.unlink(missing_ok=True)
        elif address in (None, "auto") or _same_gcs(up.address, address):
            live.append(up)
    if len(live) > 1:
        raise ParamError("address", "the GCS of one attached `specserve up`: " + ", ".join(u.address for u in live),
                         address)
    return live[0] if live else None


def stop_attached(up: AttachedUp, timeout: float) -> bool:
    """Ask an attached ``up`` to stop (SIGTERM, which it handles like Ctrl-C) and wait until its process has
    exited; False if it still runs after ``timeout`` seconds.  Exited includes a zombie its parent has not
    reaped yet (psutil's ``wait`` would wait for the reaping, which is no business of ``down``)."""
    try:
        proc = psutil.Process(up.pid)
        if proc.create_time() != up.create_time:
            return True
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while proc.status() != psutil.STATUS_ZOMBIE:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)                  # poll interval; the process's state is what is waited on
    except psutil.NoSuchProcess:
        pass
    return True


def _stop(signum, frame) -> None:
    STOP.set()
    raise KeyboardInterrupt


def interrupt_on_stop() -> None:
    """Ctrl-C and SIGTERM (``specserve down``, a service manager) both set :data:`STOP` and raise
    KeyboardInterrupt, so one handler stops ``up``.  The flag is what ``up`` trusts: the exception is raised
    wherever the main thread is, and Ray code there can turn it into something else (once in the slow suite, an
    ``up`` sent SIGINT just after it printed "Ctrl-C ... to stop" never began stopping).
    ``ray.init`` installs its own SIGTERM handler (``sys.exit``): call this again after it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop)


def wait_until_stopped(app: str, *, own_head: bool) -> tuple[str, bool]:
    """Block while ``app`` is served.  Returns why it ended -- ``"interrupted"`` (Ctrl-C or SIGTERM, now or
    earlier: :data:`STOP`; this process owns every step), ``"deleted"`` (another driver deleted the app) or
    ``"serve-gone"`` (another driver shut Serve down: its controller died) -- and whether :func:`shut_down` must
    still shut Serve down.  From its return on, Ctrl-C and SIGTERM are ignored (:func:`ignore_stop_signals`)."""
    from ray import serve
    from ray.exceptions import RayActorError
    try:
        while not STOP.is_set() and app in serve.status().applications:
            STOP.wait(POLL_S)            # poll interval; a stop signal ends the wait at once
        if STOP.is_set():
            return "interrupted", True
        # with no head of ours to stop, nothing races the other driver: its Serve is left as it is
        return "deleted", own_head and not wait_serve_gone()
    except RayActorError:
        return "serve-gone", False
    except KeyboardInterrupt:
        return "interrupted", True
    finally:
        ignore_stop_signals()


def ignore_stop_signals() -> None:
    """Once ``up`` is stopping, Ctrl-C and SIGTERM are ignored: every shutdown step is bounded (Serve's 30 s,
    the head's SIGKILL after 30 s), and one interrupted half-way would leave the head running."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def wait_serve_gone(timeout: float = EXTERNAL_SHUTDOWN_S) -> bool:
    """After another driver deleted the app: wait until Serve's controller is dead (that driver's
    ``serve.shutdown`` has done its work) or ``timeout`` passes (it only deleted the app)."""
    from ray import serve
    from ray.exceptions import RayActorError
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            serve.status()
        except RayActorError:
            return True
        time.sleep(0.2)                      # poll interval; the controller's death is what is waited on
    return False


def shut_down(node: RayNode | None, *, serve_running: bool) -> None:
    """The attached ``up``'s shutdown, in order: Serve (``serve.shutdown`` deletes every application, then
    stops the controller and proxies), this driver, the head."""
    import ray
    from ray import serve
    if serve_running:
        serve.shutdown()
    ray.shutdown()
    if node is not None:
        node.stop()
