"""A real multi-node Ray cluster on one machine: separate ``ray start`` processes, each its own Ray node.

The head (0 CPUs, resource ``node_head``) runs on 127.0.0.2, worker nodes on 127.0.0.3, .4, ... with one CPU
and a resource named after them (``node_a``, ``node_b``), so placement is observable and steerable.  Ray's
localhost (127.0.0.1) would be rewritten to the machine's outward address for a node that joins another
(cluster/serving/ops/ray_node.py), so each node gets its own 127.0.0.x: every byte stays on loopback, and each
node's processes are the process tree of its ``ray start`` PID.  Token auth is on; the token lives in ``tmp``.
Drivers run in child processes (``query``), so the test process never joins the cluster.  Leaving the
block stops every node by PID.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from cluster.serving.ops.ray_node import RayNode, auth_env, start_node, temp_dir
from tests.support.polling import poll

HEAD_IP = "127.0.0.2"
RESULT = "@@result "


class MultiNode:
    def __init__(self, tmp: Path, port: int, head_env: dict | None = None):
        self.tmp, self.port, self.head_env = tmp, port, head_env
        self.env = {**os.environ, "RAY_AUTH_TOKEN_PATH": str(tmp / "ray" / "auth_token")}
        self.head: RayNode | None = None
        self.workers: dict[str, RayNode] = {}
        self._next_ip = 3

    def __enter__(self) -> MultiNode:
        self._saved = os.environ.get("RAY_AUTH_TOKEN_PATH")
        os.environ["RAY_AUTH_TOKEN_PATH"] = self.env["RAY_AUTH_TOKEN_PATH"]      # start_node reads it
        self.env.update(auth_env(loopback=False))
        self.head = start_node(port=self.port, node_ip=HEAD_IP, num_cpus=0, resources={"node_head": 1},
                               env=self.head_env, log_path=self.tmp / "head.log", block=self.head_env is None)
        return self

    def __exit__(self, *exc) -> None:
        for node in self.workers.values():
            node.stop()
        if self.head_env is None and self.head is not None:
            self.head.stop()
        elif self.head is not None:                      # not blocking: every process of its temp dir, by PID
            for p in self.session_processes():
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self._saved is None:
            os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        else:
            os.environ["RAY_AUTH_TOKEN_PATH"] = self._saved

    @property
    def address(self) -> str:
        return self.head.address

    @property
    def temp(self) -> Path:
        """The cluster's Ray temp dir (every node's logs under session_latest/logs)."""
        return temp_dir(self.port)

    def add_worker(self, name: str, resource: str | None = None, num_cpus: float = 1) -> RayNode:
        """Start a worker node offering ``{resource or name: 1}`` and wait until the cluster lists it."""
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        node = start_node(port=0, head_address=self.address, node_ip=ip, num_cpus=num_cpus,
                          resources={resource or name: 1}, log_path=self.tmp / f"{name}.log")
        self.workers[name] = node
        poll(lambda: any(n["ip"] == ip and n["alive"] for n in self.nodes()), f"node {name} ({ip}) to join", 90)
        return node

    def query(self, code: str, *args: str, timeout: float = 120) -> object:
        """Run ``code`` as a driver of the cluster (``ADDRESS`` = its address); it calls ``emit(value)`` once."""
        script = f"import json, ray, sys\nADDRESS = {self.address!r}\n" \
                 f"def emit(v): print({RESULT!r} + json.dumps(v), flush=True)\n" \
                 "ray.init(address=ADDRESS, log_to_driver=False, include_dashboard=False, namespace='mn-test')\n" + code
        res = subprocess.run([sys.executable, "-c", script, *args], env=self.env, capture_output=True, text=True,
                             timeout=timeout, cwd=os.getcwd())
        if res.returncode != 0:
            raise AssertionError(f"driver failed: {res.stderr[-3000:]}")
        (line,) = [x for x in res.stdout.splitlines() if x.startswith(RESULT)]     # Ray prints warnings too
        return json.loads(line[len(RESULT):])

    def nodes(self) -> list[dict]:
        return self.query("emit([{'ip': n['NodeManagerAddress'], 'alive': n['Alive']} for n in ray.nodes()])")

    def actors_by_node(self) -> dict[str, list[str]]:
        """Process titles of each node's Ray workers (``ray::DraftHost``, ``ray::ServeReplica:...``): the
        node of an actor is the node whose ``ray start`` tree holds its process."""
        out = {}
        for name, node in {"head": self.head, **self.workers}.items():
            try:
                procs = psutil.Process(node.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            out[name] = sorted(_title(p) for p in procs if _title(p).startswith("ray::"))
        return out

    def session_processes(self) -> list[psutil.Process]:
        return session_processes(self.port)

    def raylet_pid(self, name: str) -> int:
        (raylet,) = [p for p in psutil.Process(self.workers[name].pid).children(recursive=True)
                     if p.name() == "raylet"]
        return raylet.pid

    def kill_node(self, name: str) -> None:
        """A node loss: SIGKILL to the node's raylet, then to every other process of it (its workers and
        actors would otherwise go on serving direct actor calls until they notice the raylet is gone), then
        its ``ray start``: all by PID, all of this node only."""
        node = self.workers.pop(name)
        procs = psutil.Process(node.pid).children(recursive=True)
        procs.sort(key=lambda p: p.name() != "raylet")          # the raylet first
        for p in procs:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.stop(timeout=10)

    def up(self, config: Path, timeout: float = 400) -> subprocess.CompletedProcess:
        """``specserve up --address`` onto this cluster (detached)."""
        return subprocess.run([sys.executable, "-m", "cluster.cli.main", "up", "--config", str(config),
                               "--address", self.address, "--detach", "--timeout", "300"],
                              env=self.env, capture_output=True, text=True, timeout=timeout)


def session_processes(port: int) -> list[psutil.Process]:
    """Every process of the cluster whose GCS port is ``port`` started from its Ray temp dir, and their children
    (workers)."""
    mark = str(temp_dir(port))
    roots = [p for p in psutil.process_iter(["cmdline"]) if any(mark in a for a in p.info["cmdline"] or ())]
    out = {p.pid: p for p in roots}
    for p in roots:
        try:
            out.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    return list(out.values())


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()).strip() or p.name()
    except psutil.NoSuchProcess:
        return ""
