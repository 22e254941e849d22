"""Beyond one machine (issue 22) on a real multi-node Ray cluster: a head and two worker nodes as separate
``ray start`` processes (tests/support/multinode.py), specserve deployed with ``specserve up --address``.

Slow (a cluster of three nodes and a deployment per module): ``python -m pytest -m slow
tests/serving/test_multinode.py``.  Traffic goes to 127.0.0.x only; every process is stopped by PID.
"""
from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import yaml

from cluster.config.schema import config_from_dict
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.local import build_engine
from cluster.serving.client.sdk import SpecServeClient
from tests.support.load import Load
from tests.support.multinode import MultiNode
from tests.support.polling import poll

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
PROMPTS = ["def fib(n):", "import os\n", "class A:\n    def", "for i in range(", "x = [", "while True:"]
MAX_NEW = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(**placement) -> dict:
    """configs/tiny.yaml with the coordinator (and the target in it) on node_a, the drafters on node_b."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cl = cfg["cluster"]
    cl.update(grpc_port=_free_port(), http_port=_free_port(), proxy_location="HeadOnly")
    cl["coordinator"] = {"num_cpus": 0.1, "resources": {"node_a": 0.01}}
    cl["drafters"] = {"num_cpus": 0.1, "resources": {placement.get("drafters", "node_b"): 0.01}}
    cfg["engine"].update(max_batch=16, max_queue=8)      # the load's 4 clients and 8 resumable streams at once
    return cfg


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multinode")
    cfg = _config()
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    with MultiNode(tmp, _free_port()) as mn:
        mn.add_worker("node_a")
        mn.add_worker("node_b")
        up = mn.up(tmp / "cfg.yaml")
        assert up.returncode == 0, up.stderr[-3000:]
        client = SpecServeClient(f"127.0.0.1:{cfg['cluster']['grpc_port']}", timeout=120)
        yield mn, cfg, client
        client.close()


@pytest.fixture(scope="module")
def reference():
    """In-process greedy autoregressive output of each prompt (the target alone)."""
    engine = build_engine(config_from_dict(yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())))
    return {p: list(engine.generate(GenerationRequest(prompt=p, max_new_tokens=MAX_NEW, sampling=SamplingParams(0.0),
                                                      strategy="autoregressive")).token_ids) for p in PROMPTS}


def test_actors_run_where_the_config_asks_and_outputs_equal_in_process(cluster, reference):
    mn, _, client = cluster
    where = mn.actors_by_node()
    assert any("ServeReplica" in t for t in where["node_a"]), where
    assert any("DraftHost" in t for t in where["node_b"]), where
    assert not any("ServeReplica" in t or "DraftHost" in t for t in where["head"]), where
    assert not any("DraftHost" in t for t in where["node_a"]), where
    for p in PROMPTS:
        for strategy in ("speculative", "autoregressive"):
            r = client.generate(p, max_new_tokens=MAX_NEW, temperature=0.0, strategy=strategy)
            assert list(r.token_ids) == reference[p], (p, strategy)


def test_cross_node_step_cost_beside_same_node(cluster, reference, record_property):
    """The coordinator on node_a; its draft side on node_a (same node) or node_b (across nodes)."""
    mn, _, _ = cluster
    engine = build_engine(config_from_dict(_config()))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    code = ("from tests.support.step_probe import StepProbe\n"
            "cfg = json.loads(sys.argv[1])\n"
            "probe = ray.remote(StepProbe).options(num_cpus=0.1, resources={'node_a': 0.01}).remote()\n"
            "emit(ray.get(probe.run.remote(cfg, json.loads(sys.argv[2]), int(sys.argv[3]))))")
    import json
    rows = {}
    for name, node in (("same node", "node_a"), ("cross node", "node_b")):
        cfg = _config(drafters=node)
        rows[name] = mn.query(code, json.dumps(cfg), json.dumps(prompts), str(MAX_NEW), timeout=300)
        assert [o for o in rows[name]["outputs"]] == [reference[p] for p in PROMPTS], name
    same, cross = rows["same node"], rows["cross node"]
    assert same["bytes_per_call"] == cross["bytes_per_call"] > 0        # the same drafts cross either way
    for k in ("step_ms", "rtt_ms", "rpc_ms", "bytes_per_call"):
        record_property(k, {n: round(r[k], 3) for n, r in rows.items()})
    print({n: {k: round(v, 3) for k, v in r.items() if k != "outputs" and not isinstance(v, str)}
           for n, r in rows.items()})
    assert cross["step_ms"] < 1.5 * same["step_ms"], rows


def test_drafter_node_loss_under_load(cluster, reference):
    """4 clients, bounded: node_b (the drafters) is killed, requests finish exactly on the target alone; a new
    node offering node_b's resource brings the drafters back and speculation resumes."""
    mn, cfg, _ = cluster
    with Load(f"127.0.0.1:{cfg['cluster']['grpc_port']}", PROMPTS, MAX_NEW) as load:
        poll(lambda: len(load.results) >= 4, "4 completions before the kill", 60)
        killed = time.monotonic()
        mn.kill_node("node_b")
        poll(lambda: len(load.after(killed, drafted=False)) >= 4 or load.failures,
             "completions on the target alone after the kill", 60)
        recovered = min(load.after(killed, drafted=False), default=killed) - killed
        back = time.monotonic()
        mn.add_worker("node_b2", resource="node_b")
        resumed = poll(lambda: min(load.after(back, drafted=True), default=None),
                       "speculation after node_b2 joined", 90)
    assert not load.failures, load.failures[:5]
    assert all(toks == reference[p] for _, p, toks, _ in load.results)
    print(f"drafter node loss: {len(load.results)} requests, 0 failures; first target-only completion "
          f"{recovered:.1f}s after the kill; speculation resumed {resumed - back:.1f}s after the new node started")
    assert resumed - back < 30


def _stream(client, prompt: str, temperature: float, seed: int, out: dict, started: set) -> None:
    """A resuming SDK stream (cluster/serving/client/sdk.py) -> out[(prompt, seed)] = (streamed ids, result ids,
    times resumed) or the exception; ``started`` gets its key once it delivered a chunk."""
    try:
        call = client.stream(prompt, max_new_tokens=STREAM_NEW, temperature=temperature, seed=seed,
                             strategy="autoregressive", ignore_eos=True)
        ids, last = [], None
        for last in call:
            ids.extend(last.token_ids)
            started.add((prompt, seed))
        out[(prompt, seed)] = (ids, list(last.result.token_ids), call.resumed)
    except Exception as e:                      # noqa: BLE001 - the test inspects it
        out[(prompt, seed)] = e


def test_target_node_loss_is_unavailable_then_serves_again(cluster, reference):
    """Last (it kills node_a): the node with the coordinator and its target dies under 4 clients that do not
    resume and 8 SDK streams that do.  The first see UNAVAILABLE only (retryable), the first within 1 s (issue
    22); once a node offers node_a again Serve rebuilds the unit and the same greedy outputs come back.  The 8
    streams (4 greedy, 4 seeded at T = 0.8) wait for the new unit and resume there from what they delivered:
    8 of 8 complete, every token once, in order, each equal to its uninterrupted twin (in-process)."""
    import threading
    mn, cfg, _ = cluster
    address = f"127.0.0.1:{cfg['cluster']['grpc_port']}"
    resuming = SpecServeClient(address, timeout=400)
    streams = [(p, 0.0 if i < 4 else 0.8, 10 + i) for i, p in enumerate((PROMPTS * 2)[:8])]
    out: dict = {}
    started: set = set()
    threads = [threading.Thread(target=_stream, args=(resuming, *s, out, started)) for s in streams]
    with Load(address, PROMPTS, MAX_NEW) as load:
        poll(lambda: len(load.results) >= 4, "4 completions before the kill", 60)
        for t in threads:
            t.start()
        poll(lambda: len(started) == 8, "the 8 streams to be delivering", 60)
        killed, killed_wall = time.monotonic(), time.time()
        mn.kill_node("node_a")
        poll(lambda: load.failures, "a failure after the target's node died", 30)
        first_failure = load.failures[0][0] - killed
        back = time.monotonic()
        mn.add_worker("node_a2", resource="node_a")
        served = poll(lambda: min(load.after(back), default=None), "serving again", 180)
        for t in threads:
            t.join(400)
    done = time.monotonic() - killed
    resuming.close()
    codes = sorted({c for _, c in load.failures})
    twins = _twins(streams)
    equal = sum(isinstance(o, tuple) and o[1] == twins[(p, seed)] for (p, seed), o in out.items())
    print(f"target node loss (killed at {killed_wall:.3f}, Ray logs in {mn.temp}): "
          f"{len(load.failures)} failures {codes}, the first {first_failure:.2f}s after the kill; "
          f"serving again {served - back:.1f}s after the new node started; {len(load.results)} completions; "
          f"resumed streams: {sum(isinstance(o, tuple) for o in out.values())} of 8 complete, {equal} equal to "
          f"their twins, resumed {[o[2] for o in out.values() if isinstance(o, tuple)]} times, all done "
          f"{done:.1f}s after the kill")
    assert codes == ["UNAVAILABLE"], codes
    # The proxy's call to the replica fails as soon as its connection breaks, since the nodes run with
    # RAY_timeout_ms_task_wait_for_death_info=0 (cluster/serving/ops/ray_node.py): measured 0.06-0.08 s; with
    # Ray's default (1000 ms, checked on a 1 s heartbeat) 1.15-1.58 s.  The GCS declares the node dead only
    # 12-15 s after the kill (its health checks), so this does not wait for that.
    assert first_failure <= 1.0
    assert all(toks == reference[p] for _, p, toks, _ in load.results)
    assert all(isinstance(o, tuple) for o in out.values()) and len(out) == 8, out
    for key, (ids, result, resumed) in out.items():
        assert ids == result and resumed >= 1, key         # every token once, in order; it did resume
    assert equal == 8


STREAM_NEW = 400


def _twins(streams) -> dict:
    """Each stream's uninterrupted run, in-process."""
    engine = build_engine(config_from_dict(yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())))
    return {(p, seed): list(engine.generate(GenerationRequest(
        prompt=p, max_new_tokens=STREAM_NEW, sampling=SamplingParams(t), seed=seed, strategy="autoregressive",
        ignore_eos=True)).token_ids) for p, t, seed in streams}
