"""The cluster end to end: a local Ray, the Serve app on configs/tiny.yaml, requests through the real
gRPC and HTTP ports; plus the tensor-parallel target (TP=2 over gloo vs TP=1) on the same Ray.

One Ray + Serve instance (the ``served`` fixture, tests/conftest.py; start-up dominates the
runtime). Synchronisation is by polling a condition with a deadline, never by sleeping a fixed time.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch

ray = pytest.importorskip("ray")

from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError
from cluster.serving.client.sdk import SpecServeClient
from cluster.core.draft.programs import DRAFTS  # noqa: E402
from cluster.strategies import REGISTRY  # noqa: E402
from tests.support.polling import poll as _poll

PROMPT = [ord(c) for c in "def fib(n):\n    return"]



def _inproc(engine, strategy, *, max_new=24, temperature=0.0, seed=0, options=None, ids=PROMPT):
    return engine.generate(GenerationRequest(prompt_ids=list(ids), max_new_tokens=max_new,
                                             sampling=SamplingParams(temperature), seed=seed,
                                             strategy=strategy, options=dict(options or {})))


def test_health_serving_after_warmup(served):
    cfg, c = served
    assert c.health() == "SERVING"
    info = c.server_info()
    assert info.ready and info.topology == "separated"
    assert {m.name for m in info.models} == set(cfg.models) | {cfg.mag.name, DRAFTS}   # + MaG, the draft side
    assert {m.role for m in info.models if m.name == DRAFTS} == {"draft-side"}
    assert {s.name for s in info.strategies} == set(REGISTRY)
    with pytest.raises(grpc.RpcError) as e:
        c.health("no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    watch = health_pb2_grpc.HealthStub(c.channel).Watch(health_pb2.HealthCheckRequest(), metadata=c.metadata)
    assert next(iter(watch)).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


@pytest.mark.parametrize("strategy", sorted(REGISTRY))
def test_greedy_generate_equals_in_process(served, served_engine, strategy):
    """Every registered strategy: same tokens as the in-process engine (or the same refusal)."""
    _, c = served
    try:
        want = _inproc(served_engine, strategy, seed=3)
    except ParamError as err:            # a strategy this config cannot serve: the cluster refuses alike
        with pytest.raises(grpc.RpcError) as e:
            c.generate(prompt_ids=PROMPT, max_new_tokens=24, temperature=0.0, seed=3, strategy=strategy)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == str(err)
        return
    got = c.generate(prompt_ids=PROMPT, max_new_tokens=24, temperature=0.0, seed=3, strategy=strategy)
    assert list(got.token_ids) == want.token_ids
    assert got.text == want.text and got.finish_reason == want.finish_reason
    assert got.stats.target_forwards == want.stats.target_forwards
    assert got.stats.accepted_tokens == want.stats.accepted_tokens


def test_stream_chunks_concatenate_to_unary(served):
    _, c = served
    unary = c.generate(prompt_ids=PROMPT, max_new_tokens=40, temperature=0.0, seed=1)
    chunks = list(c.stream(prompt_ids=PROMPT, max_new_tokens=40, temperature=0.0, seed=1))
    assert len(chunks) > 1 and chunks[-1].finish_reason == unary.finish_reason
    assert "".join(ch.text for ch in chunks) == unary.text
    assert [t for ch in chunks for t in ch.token_ids] == list(unary.token_ids)
    assert list(chunks[-1].result.token_ids) == list(unary.token_ids)
    assert all(not ch.HasField("result") for ch in chunks[:-1])


def test_seeded_sampling_reproducible(served, served_engine):
    _, c = served
    kw = dict(prompt_ids=PROMPT, max_new_tokens=32, temperature=1.0, strategy="speculative")
    a, b = c.generate(seed=7, **kw), c.generate(seed=7, **kw)
    other = c.generate(seed=8, **kw)
    assert list(a.token_ids) == list(b.token_ids) and a.seed == 7
    assert list(a.token_ids) != list(other.token_ids)
    assert list(a.token_ids) == _inproc(served_engine, "speculative", max_new=32, temperature=1.0, seed=7).token_ids


BAD = [  # (request kwargs, words the message must contain: field, range, value)
    (dict(prompt_ids=[1] * 1020, max_new_tokens=8), ["prompt", "at most 1016 tokens", "1020"]),
    (dict(prompt="hi", max_new_tokens=513), ["max_new_tokens", "[1, 512]", "513"]),
    (dict(prompt="hi", max_new_tokens=0), ["max_new_tokens", "[1, 512]", "0"]),
    (dict(prompt="hi", temperature=-0.5), ["temperature", "[0.0, 100.0]", "-0.5"]),
    (dict(prompt="hi", top_p=0.0), ["top_p", "(0.0, 1.0]", "0.0"]),
    (dict(prompt="hi", top_p=1.5), ["top_p", "(0.0, 1.0]", "1.5"]),
    (dict(prompt="hi", top_k=-1), ["top_k", ">= 0", "-1"]),
    (dict(prompt="hi", strategy="nope"), ["strategy", "speculative", "nope"]),
    (dict(prompt="hi", strategy="speculative", options={"verify": "nope"}), ["verify", "token", "nope"]),
    (dict(prompt="hi", strategy="speculative", options={"k": "0"}), ["k", "[1, 64]", "0"]),
    (dict(prompt="hi", strategy="speculative", options={"drafter": "nope"}), ["drafter", "drafter-large", "nope"]),
    (dict(prompt="hi", strategy="speculative", options={"bogus": "1"}), ["option", "speculative", "bogus"]),
    (dict(prompt=""), ["prompt", "non-empty", "''"]),
    (dict(prompt_ids=[1, 300]), ["prompt_ids", "[0, 256]", "300"]),
    (dict(prompt_ids=[-1, 2]), ["prompt_ids", "[0, 256]", "-1"]),
    (dict(prompt="hi", seed=-3), ["seed", "[0, ", "-3"]),
    (dict(prompt="hi", stop=["x" * 65]), ["stop", "1 to 64", "xxx"]),
]
if "spec_cascade" in REGISTRY:
    BAD.append((dict(prompt="hi", strategy="spec_cascade", options={"rule": "nope"}), ["rule", "one of", "nope"]))
if "cs_drafting" in REGISTRY:
    BAD.append((dict(prompt="hi", strategy="cs_drafting", options={"kmatrix": "1,x"}), ["kmatrix", "1,x"]))


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_input_invalid_argument(served, case):
    _, c = served
    kw, words = BAD[case]
    for call in (c.generate, lambda **k: list(c.stream(**k))):
        with pytest.raises(grpc.RpcError) as e:
            call(**kw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        for w in words:
            assert w in e.value.details(), (w, e.value.details())
        assert "Traceback" not in e.value.details()
    assert c.generate(prompt="ok", max_new_tokens=2).finish_reason    # still serving


def _active(c) -> dict[str, set]:
    info = c.server_info()
    return {"live": set(info.live_requests), **{m.name: set(m.active_requests) for m in info.models}}


def test_cancel_stream_frees_state_on_every_actor(served):
    _, c = served
    rid = "cancel-me"
    call = c.stream(prompt_ids=PROMPT, max_new_tokens=512, ignore_eos=True, strategy="speculative",
                    request_id=rid, temperature=0.0)
    it = iter(call)
    next(it), next(it)                                       # mid-way: state lives on the models
    act = _active(c)
    assert rid in act["live"] and rid in act["target"] and rid in act["drafter-large"]
    call.cancel()
    _poll(lambda: all(rid not in s for s in _active(c).values()), "the cancelled request to be released")
    done = [r for r in c.server_info().recent if r.request_id == rid]
    assert done and done[-1].outcome == "cancelled" and done[-1].generated_tokens < 512
    assert c.generate(prompt="ok", max_new_tokens=2).finish_reason


def test_unary_deadline_frees_state(served):
    """A unary client that gives up (deadline) stops its generation; state is freed everywhere."""
    _, c = served
    rid = "deadline"
    with pytest.raises(grpc.RpcError) as e:
        c.stub.Generate(c.request(prompt_ids=PROMPT, max_new_tokens=512, ignore_eos=True, strategy="autoregressive",
                                  request_id=rid), metadata=c.metadata, timeout=0.15)   # 512 steps take longer
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _poll(lambda: all(rid not in s for s in _active(c).values()), "the abandoned request to be released")
    done = [r for r in c.server_info().recent if r.request_id == rid]
    assert done and done[-1].outcome == "cancelled" and done[-1].generated_tokens < 512   # stopped early


def _arrivals(call) -> list[float]:
    """Consume a stream in a background thread, recording each token's arrival time (a chunk's tokens arrive
    together: the stream interval, cluster.stream, groups them)."""
    times: list[float] = []

    def read():
        try:
            for chunk in call:
                now = time.perf_counter()
                times.extend([now] * len(chunk.token_ids))
        except grpc.RpcError:
            pass
    threading.Thread(target=read, daemon=True).start()
    return times


def test_overload_resource_exhausted(served):
    cfg, c = served
    cap = cfg.engine.capacity
    calls = [c.stream(prompt_ids=PROMPT, max_new_tokens=512, ignore_eos=True, strategy="autoregressive",
                      request_id=f"hold-{i}") for i in range(cap)]
    try:
        _poll(lambda: len(_active(c)["live"]) == cap, f"{cap} live requests")
        arrivals = _arrivals(calls[0])                  # one token per engine step (autoregressive)
        with pytest.raises(grpc.RpcError) as e:
            c.generate(prompt="hi", max_new_tokens=2)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queue" in e.value.details()
        took = []                                   # refusal latency while the unit is busy (printed, -s)
        for _ in range(20):
            t0 = time.perf_counter()
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompt="hi", max_new_tokens=2)
            took.append(time.perf_counter() - t0)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        took.sort()
        ping = []                                   # the transport alone: health checks under the same load
        for _ in range(20):
            t0 = time.perf_counter()
            c.health()
            ping.append(time.perf_counter() - t0)
        ping.sort()
        _poll(lambda: len(arrivals) > 40, "the held stream to advance")
        n = len(arrivals) - 1 - 20
        step = (arrivals[-1] - arrivals[20]) / max(n, 1)
        print(f"\nrefusals under full load: p50 {took[10] * 1e3:.1f} ms, max {took[-1] * 1e3:.1f} ms "
              f"(health check meanwhile: p50 {ping[10] * 1e3:.1f} ms; "
              f"engine step: mean {step * 1e3:.1f} ms)")
    finally:
        for call in calls:
            call.cancel()
    _poll(lambda: not any(_active(c).values()), "every held request to be released")


def test_eight_concurrent_clients(served, served_engine):
    _, c = served
    strategies = ["speculative", "autoregressive"]
    jobs = [dict(prompt_ids=PROMPT[: 5 + i], max_new_tokens=20, temperature=0.0 if i % 2 else 0.8, seed=i,
                 strategy=strategies[i % 2]) for i in range(8)]
    results: dict[int, object] = {}

    def work(i):
        with SpecServeClient(c.address, timeout=120) as own:
            results[i] = own.generate(**jobs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert sorted(results) == list(range(8))
    for i, job in enumerate(jobs):
        want = _inproc(served_engine, job["strategy"], max_new=20, temperature=job["temperature"], seed=i,
                       ids=job["prompt_ids"])
        assert list(results[i].token_ids) == want.token_ids, i
    assert not any(_active(c).values())


def _http(cfg, body, path="/v1/completions"):
    req = urllib.request.Request(f"http://127.0.0.1:{cfg.cluster.http_port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, r.read().decode()


def test_openai_completions_http(served):
    cfg, c = served
    want = c.generate(prompt="def main():", max_new_tokens=16, temperature=0.0, seed=2)
    status, body = _http(cfg, {"model": "specserve", "prompt": "def main():", "max_tokens": 16,
                               "temperature": 0, "seed": 2})
    out = json.loads(body)
    assert status == 200 and out["choices"][0]["text"] == want.text
    assert out["usage"]["completion_tokens"] == len(want.token_ids)
    status, body = _http(cfg, {"prompt": "def main():", "max_tokens": 16, "temperature": 0, "seed": 2,
                               "stream": True})
    events = [line[len("data: "):] for line in body.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(urllib.error.HTTPError) as e:
        _http(cfg, {"prompt": "hi", "temperature": -1})
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and err["param"] == "temperature" and "-1" in err["message"]


def test_metrics_record():
    from cluster.core.stats import RequestStats
    from cluster.engine.request import GenerationResult
    from cluster.serving.ops.metrics import Metrics
    st = RequestStats(strategy="speculative", generated_tokens=5, steps=2, drafted_tokens=8, accepted_tokens=3,
                      accepted_per_pos=[2, 1], wall_s=0.5, ttft_s=0.1)
    Metrics().record("speculative", "ok", GenerationResult([1] * 5, "", "length", st, 0, "r"), 0.6)


# -- tensor parallel ------------------------------------------------------------------------------
def test_tensor_parallel_gloo_matches_single(served, tmp_path):
    """A unit whose target is TP=2 (two rank actors in one placement group, gloo, each loading its
    shard with transformers' tp plan from a checkpoint in tmp_path) gives the scores of TP=1 within
    1e-4 and the same greedy output as the in-process engine."""
    from cluster.config.schema import config_from_dict
    from cluster.serving.control.coordinator import Coordinator
    from tests.support.built import engine_for
    from tests.support.checkpoints import write_tiny_checkpoints
    from tests.support.reference_worker import HFWorker
    cfg = config_from_dict({"models": write_tiny_checkpoints(tmp_path),
                            "cluster": {"tp_size": 2, "backend": "gloo", "target": {"num_cpus": 0.1}}})
    coord = Coordinator(cfg)
    try:
        entry = coord.entries["target"]
        tp, actors = entry.handle, entry.handle.channel.actors
        assert entry.placement == "tp-group" and len(actors) == 2
        shapes = ray.get([a.__ray_call__.remote(
            lambda self: tuple(self.worker.model.model.layers[0].self_attn.q_proj.weight.to_local().shape))
            for a in actors])
        assert shapes == [(32, 64), (32, 64)]                 # each rank holds half of q_proj's rows
        single = HFWorker.from_pretrained(tmp_path / "target", "target")
        sp = SamplingParams(0.0)
        tp.prefill_batch([("r", PROMPT, sp, 0)])     # the remote handle: batched forms (one round trip each)
        single.prefill("r", PROMPT, sp, 0)
        draft = [5, 6, 7]
        (a,), b = tp.score_batch([("r", draft)]), single.score("r", draft)            # [4, V]
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4, rtol=0)
        for h in (tp, single):                                              # KV rollback on the shards
            h.rollback("r", len(PROMPT) + 1)
            h.extend("r", [9])
        assert torch.allclose(tp.score_batch([("r", [])])[0], single.score("r", []), atol=1e-4, rtol=0)
        for h in (tp, single):
            h.release("r")
        tp.flush()                                   # a remote handle queues a release until the step's end
        assert coord.active_requests()["target"] == []
        local = engine_for(cfg)
        for strategy in ("autoregressive", "speculative"):
            req = GenerationRequest(prompt_ids=PROMPT, max_new_tokens=24, sampling=sp, seed=0, strategy=strategy)
            assert coord.generate_blocking(req).token_ids == local.generate(req).token_ids
    finally:
        coord.shutdown()


def test_cli_client(served, capsys):
    from cluster.cli.main import main
    _, c = served
    assert main(["client", "--address", c.address, "--prompt", "def f():", "--max-new-tokens", "8",
                 "--seed", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = c.generate(prompt="def f():", max_new_tokens=8, seed=1)
    assert [int(t) for t in out.get("tokenIds", [])] == list(want.token_ids)
    assert out["finishReason"] == want.finish_reason and out["stats"]["strategy"] == want.stats.strategy
    assert main(["client", "--address", c.address, "--prompt", "x", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and "temperature" in err and "-1" in err


def test_metrics_urls_that_up_prints_are_scrapeable(served):
    from cluster.cli.cluster import metrics_urls
    urls = metrics_urls()
    assert urls and all(u.startswith("http://") and u.endswith("/metrics") for u in urls)
    body = _poll(lambda: urllib.request.urlopen(urls[0], timeout=10).read(), "the metrics endpoint")
    assert b"# TYPE" in body


def test_grpc_usage_and_server_info_count_the_prefix_cache(served):
    """The same long prompt twice over gRPC: the second response's stats count the prompt tokens the target's
    prefix cache held, and ServerInfo's running tally (what ``specserve client --info`` prints) includes them, with
    the target's cache size."""
    _, c = served
    before = c.server_info()
    prompt = "def main():\n    " + "total = total + 1\n    " * 8
    first = c.generate(prompt=prompt, max_new_tokens=3, temperature=0.0)
    second = c.generate(prompt=prompt, max_new_tokens=3, temperature=0.0)
    assert second.stats.prompt_tokens >= 32 and 16 <= second.stats.cached_tokens < second.stats.prompt_tokens
    assert second.token_ids == first.token_ids
    after = c.server_info()
    assert after.prefix_cache_queries - before.prefix_cache_queries >= 2 * second.stats.prompt_tokens
    assert after.prefix_cache_hits - before.prefix_cache_hits >= second.stats.cached_tokens
    target = next(m for m in after.models if m.role == "target")       # the cache's size per model, asked of it
    assert target.prefix_cache_tokens >= second.stats.cached_tokens and target.prefix_cache_slots >= 1
