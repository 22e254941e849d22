"""Start and stop the Ray nodes ``specserve up`` runs on, and Ray's token authentication for every process that
talks to them (docs/operator-guide.md, "Secure").

**Token authentication** (Ray >= 2.52, ``RAY_AUTH_MODE=token``): every gRPC call into the GCS, a raylet or a
worker must carry the cluster's token; a driver or a joining node without it is refused.  ``ray start --head``
turns it on by itself only when ``~/.ray/auth_token`` already exists, so the machine's history would decide.
Here every node specserve starts gets ``RAY_AUTH_MODE=token`` and the token file, which :func:`ensure_token`
creates with user-only permissions (0600) when missing; :func:`use_token` puts the same two variables into this
process's environment before it joins a cluster (``up --address``, ``down``, ``loadtest``).  The file is Ray's
own (``$RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``), so ``ray status`` and ``ray.init`` find it too.

**Loopback**: Ray binds its gRPC servers (GCS, raylet, every worker and actor) to the node's address, and to
127.0.0.1 only when that address is Ray's localhost.  ``ray start --node-ip-address 127.0.0.1`` is rewritten to
the machine's outward address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (``ray._private.services.
resolve_ip_for_localhost``; the same variable keeps a node from joining another).  So a local head runs with
it, and so does every driver of a loopback cluster (:func:`use_token` with ``loopback=True``).  Ray's nodes
are started from this interpreter's environment (``python -m ray.scripts.scripts``), not a ``ray`` on PATH.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

LOOPBACK = "127.0.0.1"
# A call whose connection to an actor breaks (its process or node died) fails at once, not after a grace period.
# Ray's core worker (actor_task_submitter.cc) otherwise parks such a call for timeout_ms_task_wait_for_death_info
# (1000 ms) in case the GCS publishes the actor's death cause meanwhile, and fails it at the next internal
# heartbeat after that (core_worker_internal_heartbeat_ms, 1000 ms): 1-2 s in all.  When a whole node dies the
# GCS learns it only from its health checks (seconds later), so the call fails with the same ACTOR_UNAVAILABLE
# either way and the wait only delays it; with 0, Serve's proxy answers a target-node loss as soon as the
# connection breaks (tests/serving/test_multinode.py: within 1 s).  KubeRay sets the same on every container of a
# RayService.
# What it costs: a call to an actor that died on a live node fails as ActorUnavailableError instead of waiting
# for ActorDiedError with its cause (Serve's router then probes the replica before dropping it).  Nothing is
# declared dead sooner (it acts only on a call whose connection already failed), so a stalled node is not.
# Every process of the node inherits it from the environment of `ray start`; a value already set there wins.
DEATH_INFO_ENV = {"RAY_timeout_ms_task_wait_for_death_info": "0"}
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"     # "0": Ray keeps 127.0.0.1 as the node address
START_TIMEOUT_S = 60.0


def token_file() -> Path:
    """Ray's token file: ``$RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token`` (Ray's default)."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def ensure_token(path: Path | None = None) -> Path:
    """Create the token file (0600, 256 random bits) if missing; tighten an existing one to 0600."""
    path = path or token_file()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            path.chmod(0o600)
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


def auth_env(*, loopback: bool) -> dict[str, str]:
    """The variables a process needs to join (or run a node of) a specserve cluster."""
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ensure_token())}
    if loopback:
        env[LOCAL_ONLY_ENV] = "0"
    return env


def is_loopback(address: str | None) -> bool:
    """Whether a Ray address (``host:port``, ``auto`` or None) names this machine's 127.0.0.1."""
    return address is None or address == "auto" or address.rsplit(":", 1)[0] in (LOOPBACK, "localhost")


def use_token(address: str | None = None) -> None:
    """Before ``import ray`` in this process: token mode, the token, and for a loopback cluster the node
    address kept at 127.0.0.1 (Ray reads that variable once, at import; else it would dial the outward
    address and never reach a loopback GCS)."""
    loopback = is_loopback(address)
    if loopback and "ray" in sys.modules and os.environ.get(LOCAL_ONLY_ENV) != "0":
        raise RuntimeError(f"use_token({address!r}) must run before `import ray` (it sets {LOCAL_ONLY_ENV}=0)")
    os.environ.update(auth_env(loopback=loopback))


@dataclass(frozen=True)
class RayNode:
    """A ``ray start --block`` process: SIGTERM to ``pid`` stops the node and every process of it."""

    pid: int
    address: str            # the cluster's GCS, host:port
    node_ip: str

    def stop(self, timeout: float = 30.0) -> None:
        stop_pid(self.pid, timeout)


def gcs_up(address: str) -> bool:
    """Whether something accepts TCP connections at a GCS address (``host:port``)."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


def temp_dir(port: int) -> Path:
    """The Ray temp dir of the cluster whose GCS port is ``port``: its own, not /tmp/ray, where ``ray start``
    would record itself as the machine's current cluster (``ray_current_cluster``), which every later
    ``ray.init()`` without an address then joins instead of starting its own.  Short: Ray's socket paths live
    under it."""
    return Path(tempfile.gettempdir()) / f"specserve-ray-{port}"


def start_node(*, port: int, head_address: str | None = None, node_ip: str = LOOPBACK,
               num_cpus: float | None = None, resources: dict | None = None, env: dict | None = None,
               log_path: Path | None = None, block: bool = True) -> RayNode:
    """Start a Ray head (``head_address`` None; GCS on ``node_ip:port``) or a node joining ``head_address``.

    A head on 127.0.0.1 keeps every Ray port on loopback (see the module docstring); the dashboard is off
    (its Jobs API runs code) and the Ray client server binds the node address.  A joining node needs an
    address other than Ray's localhost (e.g. 127.0.0.2): Ray refuses to join from a local-only node.
    ``block=False``: the node's processes outlive ``ray start`` (which returns once they run) and nothing
    watches them; with ``--block`` one of them exiting unexpectedly (a GCS killed to test its fault tolerance)
    stops the whole node.  Such a node is stopped by its processes' PIDs (``pid`` is not a live process).
    """
    gcs_port = port if head_address is None else int(head_address.rsplit(":", 1)[1])
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", *(["--block"] if block else []),
           "--disable-usage-stats", "--node-ip-address", node_ip, "--temp-dir", str(temp_dir(gcs_port))]
    if head_address is None:
        cmd += ["--head", "--port", str(port), "--include-dashboard=false", "--dashboard-host", node_ip]
    else:
        cmd += ["--address", head_address]
    if num_cpus is not None:
        cmd += ["--num-cpus", str(num_cpus)]
    if resources:
        cmd += ["--resources", json.dumps(resources)]
    # SIGTERM drains the node first (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, 30 s) so Serve proxies can stop
    # taking traffic; ours stop after Serve (down: serve.delete; up: serve.shutdown) or die with their cluster
    full_env = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **DEATH_INFO_ENV, **os.environ,
                **auth_env(loopback=node_ip == LOOPBACK and head_address is None), **(env or {})}
    if node_ip != LOOPBACK or head_address is not None:
        full_env.pop(LOCAL_ONLY_ENV, None)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL       # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    address = head_address or f"{node_ip}:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while head_address is None and not gcs_up(address):     # a joining node: the caller waits in ray.nodes()
        if proc.poll() not in (None, 0) or (proc.poll() == 0 and block):
            raise RuntimeError(f"ray start exited with {proc.returncode} (see {log_path or 'its output'})")
        if time.monotonic() > deadline:
            stop_pid(proc.pid)
            raise RuntimeError(f"Ray head on {address} not up after {START_TIMEOUT_S}s")
        time.sleep(0.2)                      # poll interval; the condition is what synchronises
    return RayNode(proc.pid, address, node_ip)


def stop_pid(pid: int, timeout: float = 30.0) -> None:
    """SIGTERM ``pid`` (a ``ray start --block``: it stops its node's processes), SIGKILL after ``timeout``."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            waited, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:              # not our child: poll its existence instead
            waited = 0 if _alive(pid) else pid
        if waited == pid:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def head_state_file() -> Path:
    """Where a detached ``specserve up`` records the head it started (beside the token, 0600)."""
    return token_file().parent / "specserve-head.json"


def save_head(node: RayNode) -> Path:
    path = head_state_file()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": node.pid, "address": node.address, "node_ip": node.node_ip}, f)
    return path


def load_head() -> RayNode | None:
    """The head a detached ``specserve up`` started, if it is still running."""
    try:
        node = RayNode(**json.loads(head_state_file().read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return node if _alive(node.pid) else None
