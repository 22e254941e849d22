"""``specserve down`` against a real attached ``specserve up`` (cluster/serving/ops/attached.py): the attached
``up`` owns every shutdown step, so ``down`` returns in seconds with rc 0, neither prints a traceback or a GCS
error, and ``up`` exits 0 with its Ray head and every process of its cluster gone.

Each ``up`` runs configs/tiny.yaml as a subprocess on free loopback ports, with its token (and so its records)
in the test's tmp dir; whatever the test started is killed by PID in a ``finally``.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import psutil
import pytest
import yaml

from cluster.errors import ParamError
from cluster.serving.ops.attached import (STOP, AttachedUp, attached_file, find_attached, interrupt_on_stop, save_attached,
                                          wait_until_stopped)
from cluster.serving.ops.ray_node import stop_pid
from tests.support.multinode import session_processes
from tests.support.polling import poll

CLI = [sys.executable, "-m", "cluster.cli.main"]
DOWN_BOUND_S = 30.0
BAD = ("Traceback", "GCS", "Failed to connect")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Up:
    """``specserve up`` (attached) on configs/tiny.yaml, started as a subprocess and waited for until SERVING."""

    def __init__(self, tmp: Path):
        self.tmp, self.ray_port = tmp, _free_port()
        cfg = yaml.safe_load(Path("configs/tiny.yaml").read_text())
        cfg["cluster"].update(grpc_port=_free_port(), http_port=_free_port())
        (tmp / "tiny.yaml").write_text(yaml.safe_dump(cfg))
        self.env = {**os.environ, "RAY_AUTH_TOKEN_PATH": str(tmp / "ray" / "auth_token")}
        self.err_path = tmp / "up.err"
        self.proc: subprocess.Popen | None = None
        self.head_pid: int | None = None

    def __enter__(self) -> Up:
        return self

    def start(self, *args: str) -> None:
        """``specserve up`` with ``args``; returns once it serves (or, ``--detach``, once it has returned)."""
        with open(self.err_path, "wb") as err, open(self.tmp / "up.out", "wb") as out:
            self.proc = subprocess.Popen([*CLI, "up", "--config", str(self.tmp / "tiny.yaml"), "--ray-port",
                                          str(self.ray_port), "--timeout", "300", *args], env=self.env,
                                         stdout=out, stderr=err)
        poll(lambda: "SERVING" in self.err() or self.proc.poll() is not None, "specserve up to serve", 300)
        head = re.search(r"Ray head on \S+ \(pid (\d+);", self.err())
        self.head_pid = int(head.group(1)) if head else None
        assert "SERVING" in self.err() and self.head_pid, self.err()[-3000:]

    def __exit__(self, *exc) -> None:
        leftovers = self.cluster_processes()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.head_pid is not None:
            stop_pid(self.head_pid, timeout=10)
        for p in leftovers:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass

    def err(self) -> str:
        return self.err_path.read_text(errors="replace") + (self.tmp / "up.out").read_text(errors="replace")

    def down(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([*CLI, "down", *args], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    def cluster_processes(self) -> list[psutil.Process]:
        """Every live process of this cluster (started from its own Ray temp dir, and their children)."""
        return [p for p in session_processes(self.ray_port) if _alive(p)]

    def assert_stopped_cleanly(self, down_err: str = "") -> None:
        assert self.proc.wait(timeout=DOWN_BOUND_S) == 0, self.err()[-3000:]
        for text in (self.err(), down_err):
            assert not [b for b in BAD if b in text], text[-3000:]
        assert not psutil.pid_exists(self.head_pid) or not _alive(psutil.Process(self.head_pid))
        poll(lambda: not self.cluster_processes(), "every process of the cluster to exit", 15)
        assert not list((self.tmp / "ray").glob("specserve-*.json"))      # its records are removed


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow      # ~50 s (a whole `up` started and stopped); the slow suite's
def test_down_stops_an_attached_up(tmp_path):
    with Up(tmp_path) as up:
        up.start()
        start = time.monotonic()
        down = up.down()                                 # no --address: the attached up's record names it
        _, err = down.communicate(timeout=120)
        took = time.monotonic() - start
        assert down.returncode == 0, err[-3000:]
        assert took < DOWN_BOUND_S, (took, err[-3000:])
        assert f"stopped by its `specserve up` (pid {up.proc.pid}) with its Ray head (pid {up.head_pid})" in err
        up.assert_stopped_cleanly(err)
        assert "stopping (Ctrl-C or `specserve down`)" in up.err()
        assert f"specserve: stopped, Ray head (pid {up.head_pid}) included" in up.err()


@pytest.mark.slow
def test_ctrl_c_on_up_while_down_waits(tmp_path):
    """Ctrl-C on ``up`` after ``down`` asked it to stop: ignored (it is already stopping), both end cleanly."""
    with Up(tmp_path) as up:
        up.start()
        down = up.down("--address", f"127.0.0.1:{up.ray_port}")
        poll(lambda: "specserve: stopping" in up.err(), "up to start stopping", 60)
        os.kill(up.proc.pid, signal.SIGINT)
        _, err = down.communicate(timeout=120)
        assert down.returncode == 0, err[-3000:]
        up.assert_stopped_cleanly(err)


@pytest.mark.slow
def test_ctrl_c_alone_stops_up_and_its_head(tmp_path):
    with Up(tmp_path) as up:
        up.start()
        os.kill(up.proc.pid, signal.SIGINT)
        up.assert_stopped_cleanly()
        assert f"specserve: stopped, Ray head (pid {up.head_pid}) included" in up.err()


@pytest.mark.slow
def test_down_stop_ray_stops_a_detached_up(tmp_path):
    """``up --detach`` returns and records its head; ``down --stop-ray``, one process, deletes the app, shuts
    Serve down, disconnects, then stops that head."""
    with Up(tmp_path) as up:
        up.start("--detach")
        assert up.proc.wait(timeout=60) == 0, up.err()[-3000:]
        assert json.loads((tmp_path / "ray" / "specserve-head.json").read_text())["pid"] == up.head_pid
        down = up.down("--stop-ray")
        _, err = down.communicate(timeout=120)
        assert down.returncode == 0, err[-3000:]
        assert f"(pid {up.head_pid}) stopped" in err
        up.assert_stopped_cleanly(err)


def test_a_stop_that_a_call_swallows_still_ends_the_wait(monkeypatch):
    """Ctrl-C lands inside a Serve status call that swallows the KeyboardInterrupt (as Ray code can): the flag
    the handler set still ends ``up``'s wait at once, reported as an interrupt, and Serve is still to shut down."""
    from ray import serve
    calls = []

    def status():
        calls.append(1)
        assert len(calls) < 4, "up kept waiting after Ctrl-C"
        if len(calls) == 1:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):             # the handler runs in this thread at the next bytecodes
                    pass
            except KeyboardInterrupt:
                pass
        return type("Status", (), {"applications": {"specserve": None}})()

    monkeypatch.setattr(serve, "status", status)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        interrupt_on_stop()
        assert wait_until_stopped("specserve", own_head=True) == ("interrupted", True)
        assert calls == [1] and STOP.is_set()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN        # stopping: further Ctrl-C is ignored
    finally:
        STOP.clear()
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_down_with_no_cluster_is_one_line(tmp_path):
    """Nothing listens at the address: one line naming it, rc 1, at once (Ray would retry for minutes)."""
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "ray" / "auth_token")}
    res = subprocess.run([*CLI, "down", "--address", f"127.0.0.1:{port}"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 1
    assert res.stderr.strip() == f"specserve: no Ray cluster at 127.0.0.1:{port} (nothing listens there)"


def test_find_attached_matches_live_records_only(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))
    me = save_attached("127.0.0.1:6390", "specserve", None)        # this process stands in for a live `up`
    reused = replace(me, create_time=me.create_time + 1, address="127.0.0.1:6391")    # its PID, another process
    attached_file(reused.address).write_text(json.dumps(asdict(reused)))
    assert find_attached(None) == me and find_attached("auto") == me and find_attached("localhost:6390") == me
    assert find_attached("127.0.0.1:6379") is None and find_attached("10.0.0.5:6390") is None
    assert not attached_file(reused.address).exists()               # the record of a gone process is removed
    save_attached("127.0.0.1:6392", "other", None)
    with pytest.raises(ParamError, match="address"):
        find_attached(None)
    assert find_attached("127.0.0.1:6392").app == "other"


def test_down_signals_the_recorded_process_and_waits_for_it(tmp_path, monkeypatch):
    """Without Ray: a stand-in ``up`` (a child that dies of SIGTERM and stays unreaped, a zombie) recorded as
    attached; ``down --app`` naming another app is refused before any signal, ``down`` stops it."""
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))
    env = dict(os.environ)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        up = AttachedUp(child.pid, psutil.Process(child.pid).create_time(), "127.0.0.1:6390", "specserve", None)
        attached_file(up.address).write_text(json.dumps(asdict(up)))
        res = subprocess.run([*CLI, "down", "--app", "other"], env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and "invalid app: 'other'" in res.stderr, res.stderr
        assert child.poll() is None
        res = subprocess.run([*CLI, "down"], env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert f"specserve stopped by its `specserve up` (pid {child.pid}) in" in res.stderr
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()
