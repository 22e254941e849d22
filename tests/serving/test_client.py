"""SpecServeClient against the served cluster (issue 23, point 5): the default deadline, the retry policy in
its channel, readiness through health Watch; the policy's own semantics against loopback servers are in
test_client_policy.py."""
from __future__ import annotations

import grpc
import pytest

from cluster.serving.client.sdk import SpecServeClient
from cluster.serving.client.policy import DEFAULT_TIMEOUT_S, channel_options


def _client(cfg, **kw) -> SpecServeClient:
    return SpecServeClient(f"127.0.0.1:{cfg.cluster.grpc_port}", app=cfg.cluster.app_name, **kw)


def test_defaults_and_a_request_through_the_retrying_channel(served):
    cfg, _ = served
    with _client(cfg) as c:
        assert c.timeout == DEFAULT_TIMEOUT_S > cfg.engine.request_timeout_s   # the server's deadline answers first
        assert c.options == channel_options()
        c.wait_ready(60)                                    # Watch reports SERVING at once on a warm unit
        want = c.generate("def main():", max_new_tokens=8, temperature=0.0, seed=3)
        chunks = list(c.stream("def main():", max_new_tokens=8, temperature=0.0, seed=3))
    assert len(want.token_ids) == 8
    assert [t for ch in chunks for t in ch.token_ids] == list(want.token_ids)   # every token once


def test_the_deadline_is_the_clients_and_configurable(served):
    cfg, _ = served
    with _client(cfg, timeout=0.001) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate("def main():", max_new_tokens=64, temperature=0.0)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_wait_ready_names_what_it_waited_for():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                  # closed again: nothing listens there
    with SpecServeClient(f"127.0.0.1:{port}") as c, pytest.raises(TimeoutError, match="not connected"):
        c.wait_ready(0.5)
