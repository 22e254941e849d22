"""Ray's token for every process specserve starts (cluster/serving/ops/ray_node.py), without starting Ray."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

from cluster.serving.ops.ray_node import auth_env, ensure_token, is_loopback


def test_token_is_created_user_only_and_kept(tmp_path):
    path = ensure_token(tmp_path / "ray" / "auth_token")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = path.read_text()
    assert len(token) == 64 and ensure_token(path).read_text() == token       # reused, never regenerated
    path.chmod(0o644)
    assert stat.S_IMODE(ensure_token(path).stat().st_mode) == 0o600           # a readable token is tightened


def test_auth_env_turns_token_mode_on(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "t"))
    env = auth_env(loopback=True)
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "t"),
                   "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in auth_env(loopback=False)
    assert is_loopback("127.0.0.1:6379") and is_loopback(None) and not is_loopback("10.0.0.5:6379")


def test_bad_grpc_host_is_refused_before_ray_starts(tmp_path):
    env = {**os.environ, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "token")}
    res = subprocess.run([sys.executable, "-m", "cluster.cli.main", "up", "--config", "configs/tiny.yaml",
                          "--grpc-host", "my.host"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "invalid grpc_host: 'my.host' (allowed: an IP address" in res.stderr
    assert not (tmp_path / "specserve-head.json").exists()
