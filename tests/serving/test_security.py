"""Secure by default (issue 24), tested from outside: a cluster that ``specserve up`` starts, seen from another
network namespace joined by a veth pair (tests/support/netns.py).

From the namespace every port of the cluster's processes must refuse a connection, except the gRPC proxy,
which ``--grpc-host`` put on the outer veth address: there it speaks only TLS (a plaintext client fails the
handshake) and answers only with the API key.  Ray's control plane needs its token: a driver without it is
refused.  Everything the test starts (the namespace, the Ray head and its processes) is stopped by PID/name.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.netns import PROBE, Netns, listening_ports, netns_unavailable

API_KEY = "test-key-24"
GRPC_CALLS = """
import sys
from cluster.serving.client.sdk import SpecServeClient
from cluster.errors import ParamError
import grpc
addr, ca, key = sys.argv[1:4]
def call(**kw):
    try:
        with SpecServeClient(addr, timeout=60, **kw) as c:
            return "OK " + str(len(c.generate("def f(x):", max_new_tokens=4).token_ids))
    except grpc.RpcError as e:
        return e.code().name
print("plaintext", call(api_key=key))
print("tls_nokey", call(api_key="", tls=True, ca=ca))
print("tls_key", call(api_key=key, tls=True, ca=ca))
"""


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _self_signed(tmp: Path, ip: str) -> tuple[Path, Path]:
    cert, key = tmp / "tls.crt", tmp / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", str(key),
                    "-out", str(cert), "-subj", "/CN=specserve-test", "-addext", f"subjectAltName=IP:{ip}"],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """(namespace, cluster facts): a TLS cluster on configs/tiny.yaml, gRPC on the namespace's outer address."""
    why = netns_unavailable() or (None if shutil.which("openssl") else "needs the openssl command (certificate)")
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("secure")
    cfg = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    cfg["cluster"].update(grpc_port=_free_port(), http_port=_free_port())
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "RAY_AUTH_TOKEN_PATH": str(tmp / "ray" / "auth_token"), "SPECSERVE_API_KEY": API_KEY}
    with Netns() as ns:
        cert, key = _self_signed(tmp, ns.outer)
        up = subprocess.run([sys.executable, "-m", "cluster.cli.main", "up", "--config", str(tmp / "tiny.yaml"),
                             "--detach", "--ray-port", str(_free_port()), "--grpc-host", ns.outer,
                             "--tls-cert", str(cert), "--tls-key", str(key), "--timeout", "300"],
                            env=env, capture_output=True, text=True, timeout=400)
        state = tmp / "ray" / "specserve-head.json"
        head = json.loads(state.read_text()) if state.exists() else None
        try:
            assert up.returncode == 0, up.stderr[-3000:]
            yield ns, dict(head=head, cfg=cfg, cert=cert, env=env, log=up.stderr)
        finally:
            if head is not None:
                from cluster.serving.ops.ray_node import stop_pid
                stop_pid(head["pid"])


def test_every_port_but_grpc_refuses_from_outside(outside):
    ns, c = outside
    ports = listening_ports(c["head"]["pid"])
    grpc_port, http_port = c["cfg"]["cluster"]["grpc_port"], c["cfg"]["cluster"]["http_port"]
    assert grpc_port in ports and http_port in ports and len(ports) > 8, ports   # measured the right tree
    probe = ns.run(PROBE, ns.outer, *map(str, ports))
    states = dict(line.split() for line in probe.stdout.split("\n") if line)
    reachable = {p: ports[int(p)] for p, s in states.items() if s != "refused"}
    assert set(reachable) == {str(grpc_port)}, (reachable, probe.stderr[-2000:])
    assert f"gRPC {ns.outer}:{grpc_port} TLS" in c["log"]


def test_grpc_from_outside_needs_tls_and_the_key(outside):
    ns, c = outside
    res = ns.run(GRPC_CALLS, f"{ns.outer}:{c['cfg']['cluster']['grpc_port']}", str(c["cert"]), API_KEY)
    got = dict(line.split(" ", 1) for line in res.stdout.split("\n") if line)
    assert got == {"plaintext": "UNAVAILABLE", "tls_nokey": "UNAUTHENTICATED", "tls_key": "OK 4"}, \
        (got, res.stderr[-2000:])


def test_a_driver_without_the_token_is_refused(outside, tmp_path):
    _, c = outside
    code = ("import ray, sys\ntry:\n    ray.init(address=sys.argv[1], include_dashboard=False)\n"
            "    print('connected')\nexcept ConnectionError as e:\n    print('refused')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(tmp_path), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",     # no ~/.ray/auth_token there
               RAY_NUM_REDIS_GET_RETRIES="2")          # Ray's connect retries (20 by default, ~1 s each)
    res = subprocess.run([sys.executable, "-c", code, c["head"]["address"]], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.stdout.strip() == "refused" and "InvalidAuthToken" in res.stderr, res.stderr[-2000:]
    with_token = subprocess.run([sys.executable, "-c", code, c["head"]["address"]],
                                env={**env, **{k: v for k, v in c["env"].items() if k.startswith("RAY_AUTH")},
                                     "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=120)
    assert with_token.stdout.strip() == "connected", with_token.stderr[-2000:]


def test_token_file_is_user_only(outside):
    mode = Path(outside[1]["env"]["RAY_AUTH_TOKEN_PATH"]).stat().st_mode & 0o777
    assert mode == 0o600


def test_client_tls_arguments_are_checked(tmp_path):
    from cluster.errors import ParamError
    from cluster.serving.client.sdk import SpecServeClient
    with pytest.raises(ParamError, match=r"invalid ca: .* \(allowed: only with tls=True"):
        SpecServeClient("127.0.0.1:1", ca=str(tmp_path / "ca.pem"))
    with pytest.raises(ParamError, match=r"invalid ca: .* \(allowed: a readable PEM file"):
        SpecServeClient("127.0.0.1:1", tls=True, ca=str(tmp_path / "missing.pem"))
