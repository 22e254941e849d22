"""A Serve replica (a whole serving unit's coordinator) killed by PID under load: a client that does not resume
gets a clean ``UNAVAILABLE`` (no pid, node address or Ray text); the SDK's resuming stream and unary call wait
for the replica Serve starts instead and complete, each equal to its uninterrupted twin token for token (seeded
sampling), the stream with every token once.  Runs a second application ("victim") on the session's Serve
instance, so the shared app is untouched.
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


def test_killed_replica_streams_resume_on_its_replacement(victim, tiny_engine):
    cfg, c = victim
    plain = SpecServeClient(c.address, app=APP, timeout=120, resume=0)
    kw = dict(prompt=PROMPT, max_new_tokens=400, ignore_eos=True, strategy="autoregressive", temperature=0.8)
    out: dict = {}
    started: set = set()                         # the streams that delivered a chunk

    def hold(kind: str) -> None:
        try:
            if kind == "unary":
                out[kind] = list(c.generate(seed=2, **kw).token_ids)
            else:
                call = (plain if kind == "plain" else c).stream(seed=1, **kw)
                ids, last = [], None
                for last in call:
                    ids.extend(last.token_ids)
                    started.add(kind)
                out[kind] = (ids, list(last.result.token_ids), getattr(call, "resumed", 0))
        except Exception as e:                  # noqa: BLE001 - the test inspects it
            out[kind] = e

    threads = [threading.Thread(target=hold, args=(k,)) for k in ("plain", "stream", "unary")]
    for t in threads:
        t.start()
    poll(lambda: len(started) == 2 and len(c.server_info().live_requests) == 3,
         "the three requests to be running and both streams delivering")
    old = _replica_pid()
    os.kill(old, signal.SIGKILL)
    t_kill = time.perf_counter()
    for t in threads:
        t.join(150)
    done_in = time.perf_counter() - t_kill
    plain.close()
    assert set(out) == {"plain", "stream", "unary"}, (out, done_in)
    e = out["plain"]
    assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNAVAILABLE, e
    assert e.details() == REPLICA_LOST
    assert not re.search(r"\d+\.\d+\.\d+\.\d+|pid|Traceback|actor", e.details(), re.I)
    twin = {seed: tiny_engine.generate(GenerationRequest(prompt=PROMPT, max_new_tokens=400, ignore_eos=True,
                                                         sampling=SamplingParams(0.8), seed=seed,
                                                         strategy="autoregressive")).token_ids for seed in (1, 2)}
    streamed, result, resumed = out["stream"]
    assert resumed >= 1 and streamed == result == twin[1]       # every token once, in order, as uninterrupted
    assert out["unary"] == twin[2]
    assert _replica_pid() != old
    print(f"\nServe replica killed: the non-resuming client got UNAVAILABLE; the resumed stream and the re-sent "
          f"unary request completed {done_in:.1f}s after the kill, equal to their twins")


@pytest.mark.slow      # ~45 s (a second two-unit application); the slow suite's
def test_a_removed_unit_moves_its_streams_to_the_other(served, tiny_engine):
    """Drain: a two-unit application scaled down to one unit (a downscale, as the autoscaler or a rolling update
    removes a unit) with ``drain_timeout_s: 1``: the removed unit's streams break once the drain time is up and
    the SDK resumes them on the remaining unit; all four complete, every token once, equal to their twins."""
    from ray import serve

    from cluster.serving.fronts.app import build_app
    cfg, _ = served
    two = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, app_name="drain", replicas=2,
                                                               drain_timeout_s=1.0))
    serve.run(build_app(two), name="drain", route_prefix="/drain")
    c = SpecServeClient(f"127.0.0.1:{cfg.cluster.grpc_port}", app="drain", timeout=300)
    try:
        c.wait_ready(300)
        kw = dict(prompt=PROMPT, max_new_tokens=500, ignore_eos=True, strategy="autoregressive", temperature=0.8)
        out: dict = {}
        started: set = set()

        def hold(seed: int) -> None:
            try:
                call = c.stream(seed=seed, **kw)
                ids, last = [], None
                for last in call:
                    ids.extend(last.token_ids)
                    started.add(seed)
                out[seed] = (ids, list(last.result.token_ids), call.resumed)
            except Exception as e:              # noqa: BLE001 - the test inspects it
                out[seed] = e

        threads = [threading.Thread(target=hold, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        poll(lambda: len(started) == 4, "the four streams to be delivering")
        serve.run(build_app(dataclasses.replace(two, cluster=dataclasses.replace(two.cluster, replicas=1))),
                  name="drain", route_prefix="/drain")
        for t in threads:
            t.join(300)
        twin = {seed: tiny_engine.generate(GenerationRequest(prompt=PROMPT, max_new_tokens=500, ignore_eos=True,
                                                             sampling=SamplingParams(0.8), seed=seed,
                                                             strategy="autoregressive")).token_ids
                for seed in range(4)}
        assert all(isinstance(o, tuple) for o in out.values()) and len(out) == 4, out
        for seed, (ids, result, _) in out.items():
            assert ids == result == twin[seed], seed
        moved = sum(o[2] for o in out.values())
        assert moved >= 1                      # the removed unit held some: they moved instead of holding it up
        print(f"\ndownscale from 2 units to 1: {moved} of 4 streams moved to the remaining unit, all equal to "
              f"their twins")
    finally:
        c.close()
        serve.delete("drain")
