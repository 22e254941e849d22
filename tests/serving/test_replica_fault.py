"""A Serve replica (a whole serving unit's coordinator) killed by PID under load: its clients get a clean
``UNAVAILABLE`` (no pid, node address or Ray text), Serve starts a new replica, and it serves the same greedy
output.  Runs a second application ("victim") on the session's Serve instance, so the shared app is untouched.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import threading
import time

import grpc
import pytest

ray = pytest.importorskip("ray")

from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.serving.client.sdk import SpecServeClient
from protos.guard import REPLICA_LOST
from tests.support.polling import poll

PROMPT = "def fib(n):\n    return"
APP = "victim"


def _replica_pid() -> int:
    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP}#")]
    assert len(names) == 1, names
    actor = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


@pytest.fixture(scope="module")
def victim(served):
    from ray import serve

    from cluster.serving.fronts.app import build_app
    cfg, _ = served
    vcfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, app_name=APP))
    serve.run(build_app(vcfg), name=APP, route_prefix=f"/{APP}")
    # the default, retrying client: a request that reached the lost replica is answered UNAVAILABLE with a
    # negative retry pushback, so not even the unary call (uncommitted until it ends) is re-sent
    client = SpecServeClient(f"127.0.0.1:{cfg.cluster.grpc_port}", app=APP, timeout=120)
    client.wait_ready(300)
    yield vcfg, client
    client.close()
    serve.delete(APP)


def test_killed_replica_gives_unavailable_and_serve_restarts_it(victim, tiny_engine):
    cfg, c = victim
    errors: list = []

    def hold(kind: str) -> None:
        kw = dict(prompt=PROMPT, max_new_tokens=512, ignore_eos=True, strategy="autoregressive")
        try:
            if kind == "stream":
                for _ in c.stream(**kw):
                    pass
            else:
                c.generate(**kw)
            errors.append(None)
        except grpc.RpcError as e:
            errors.append(e)

    threads = [threading.Thread(target=hold, args=(k,)) for k in ("stream", "unary")]
    for t in threads:
        t.start()
    poll(lambda: len(c.server_info().live_requests) == 2, "both requests to be running")
    old = _replica_pid()
    os.kill(old, signal.SIGKILL)
    t_kill = time.perf_counter()
    for t in threads:
        t.join(90)
    failed_in = time.perf_counter() - t_kill
    assert len(errors) == 2 and all(e is not None for e in errors), errors
    for e in errors:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
        assert e.details() == REPLICA_LOST
        assert not re.search(r"\d+\.\d+\.\d+\.\d+|pid|Traceback|actor", e.details(), re.I)

    quick = SpecServeClient(c.address, app=APP, timeout=5)

    def serving_again() -> bool:
        try:
            return quick.health() == "SERVING" and _replica_pid() != old
        except (grpc.RpcError, AssertionError, ray.exceptions.RayError):
            return False
    poll(serving_again, "Serve to start a new replica", timeout=180)
    recovered_in = time.perf_counter() - t_kill
    quick.close()
    got = c.generate(prompt_ids=list(PROMPT.encode()), max_new_tokens=16, strategy="speculative", temperature=0.0)
    want = tiny_engine.generate(GenerationRequest(prompt_ids=list(PROMPT.encode()), max_new_tokens=16,
                                                  sampling=SamplingParams(0.0), strategy="autoregressive"))
    assert list(got.token_ids) == want.token_ids
    print(f"\nServe replica killed: clients got UNAVAILABLE after {failed_in:.1f}s; a new replica served "
          f"after {recovered_in:.1f}s")
