"""A network namespace joined to this one by a veth pair: a second machine's view of our ports, on one host.

``with Netns() as ns``: namespace ``ns.name`` with ``ns.inner`` (10.213.X.2/30) inside and ``ns.outer``
(10.213.X.1/30) here; ``ns.run(code, *args)`` runs Python inside it.  Needs root (``ip netns``); only the
addresses of this pair are used, and leaving the block deletes the namespace (and with it both veth ends).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import psutil


def netns_unavailable() -> str | None:
    """Why a namespace cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create a network namespace (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install iproute2)"
    return None


class Netns:
    def __init__(self):
        tag = os.getpid() % 250 + 1
        self.name, self.veth_out, self.veth_in = f"ssv{os.getpid()}", f"ssvo{tag}", f"ssvi{tag}"
        self.outer, self.inner = f"10.213.{tag}.1", f"10.213.{tag}.2"

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def __enter__(self) -> Netns:
        self._ip("netns", "add", self.name)
        try:
            self._ip("link", "add", self.veth_out, "type", "veth", "peer", "name", self.veth_in)
            self._ip("link", "set", self.veth_in, "netns", self.name)
            self._ip("addr", "add", f"{self.outer}/30", "dev", self.veth_out)
            self._ip("link", "set", self.veth_out, "up")
            for cmd in (("addr", "add", f"{self.inner}/30", "dev", self.veth_in), ("link", "set", self.veth_in, "up"),
                        ("link", "set", "lo", "up")):
                self._ip("netns", "exec", self.name, "ip", *cmd)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "link", "del", self.veth_out], capture_output=True)     # gone with the netns too
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

    def run(self, code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """``python -c code args...`` inside the namespace, from the repository root."""
        return subprocess.run(["ip", "netns", "exec", self.name, sys.executable, "-c", code, *args],
                              capture_output=True, text=True, timeout=timeout, cwd=os.getcwd())


def listening_ports(root_pid: int) -> dict[int, str]:
    """TCP ports listened on by ``root_pid`` and its descendants: port -> 'process name on address'."""
    out: dict[int, str] = {}
    procs = [psutil.Process(root_pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
            name = p.name()
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                out[c.laddr.port] = f"{name} on {c.laddr.ip}"
    return out


# Run inside the namespace: argv = host, ports...; prints "port state" per line (refused | open | timeout).
PROBE = """
import socket, sys
host = sys.argv[1]
for port in map(int, sys.argv[2:]):
    s = socket.socket(); s.settimeout(2.0)
    try:
        s.connect((host, port)); state = "open"
    except ConnectionRefusedError:
        state = "refused"
    except OSError:
        state = "timeout"
    finally:
        s.close()
    print(port, state)
"""
