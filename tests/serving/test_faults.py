"""Faults survived, on a real unit (local Ray, configs/tiny.yaml, every model its own actor).

Actors are killed by PID (SIGKILL, only processes this test's Ray started) while requests run:
- a drafter or the Max-Gram drafter dies: its requests go on on the target alone with the same greedy output,
  Ray restarts the actor, the engine prefills it again and speculation resumes;
- the target dies (or one rank of a TP group): ``ready`` (health) turns false, Ray restarts the actor (the unit
  rebuilds the group), and the in-flight requests resume from the tokens they emitted, each equal to its
  uninterrupted twin token for token, greedy and seeded sampling (Engine._suspend); with
  ``engine.resume_limit: 0`` they fail with ModelUnavailableError (gRPC UNAVAILABLE) within seconds instead.
Recovery times are printed (``pytest -s``).  Synchronisation is by polling conditions with deadlines.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest

from cluster.config.schema import MagSpec, load_config
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ModelUnavailableError
from tests.support.built import engine_for
from tests.support.polling import DEADLINE_S
from tests.support.polling import poll as _poll

ray = pytest.importorskip("ray")

PROMPT = [ord(c) for c in "def fib(n):\n    return"]



@pytest.fixture(scope="module")
def unit():
    from cluster.serving.control.coordinator import Coordinator
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, namespace="specserve-test", log_to_driver=False)
    cfg = load_config("configs/tiny.yaml")
    cfg = dataclasses.replace(cfg, mag=MagSpec(), cluster=dataclasses.replace(
        cfg.cluster, call_timeout_s=10.0, target_placement="actor"))     # every model its own actor
    local = engine_for(cfg)                     # builds the bigram table too (entry point)
    coord = Coordinator(cfg)
    coord.warmup(2)
    yield coord, local
    coord.shutdown()


def _req(strategy, n=48, seed=0, temperature=0.0, **options):
    return GenerationRequest(prompt_ids=PROMPT, max_new_tokens=n, sampling=SamplingParams(temperature), seed=seed,
                             strategy=strategy, options=options, ignore_eos=True)


def _pid(coord, name) -> int | None:
    """The model actor's process id; None while Ray restarts it."""
    actor = coord.entries[name].handle.channel.actors[0]
    try:
        return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    except ray.exceptions.ActorUnavailableError:
        return None


def _run_concurrently(coord, reqs):
    results = [None] * len(reqs)

    def one(i):
        try:
            results[i] = coord.generate_blocking(reqs[i], timeout=DEADLINE_S)
        except Exception as e:                  # noqa: BLE001 - the test inspects it
            results[i] = e
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    return threads, results


@pytest.mark.parametrize("victim,strategy", [("drafter-large", "speculative"), ("mag", "mag")])
def test_dead_drafter_requests_continue_on_the_target(unit, victim, strategy):
    coord, local = unit
    options = {"drafter": victim} if strategy == "speculative" else {}
    want = [local.generate(_req("autoregressive", seed=i)).token_ids for i in range(3)]
    steps_before = coord.engine.steps
    threads, results = _run_concurrently(coord, [_req(strategy, seed=i, **options) for i in range(3)])
    _poll(lambda: coord.engine.steps >= steps_before + 2, "the requests to be decoding")
    old = _pid(coord, victim)
    os.kill(old, signal.SIGKILL)
    t_kill = time.perf_counter()
    for t in threads:
        t.join(DEADLINE_S)
    assert [r.token_ids if not isinstance(r, Exception) else r for r in results] == want
    _poll(lambda: victim not in coord.engine.health.down and _pid(coord, victim) not in (None, old),
          f"{victim} to be restarted")
    again = coord.generate_blocking(_req(strategy, seed=7, **options), timeout=DEADLINE_S)
    assert again.token_ids == local.generate(_req("autoregressive", seed=7)).token_ids
    assert again.stats.steps > 0                          # drafting again (verification steps ran)
    print(f"\n{victim} killed under load: 3/3 requests completed; recovered in "
          f"{time.perf_counter() - t_kill:.1f}s")
    assert not any(ids for ids in coord.active_requests().values())


@pytest.mark.parametrize("temperatures", [(0.0, 0.0), (0.8,)], ids=["greedy-two", "sampled-alone"])
def test_dead_target_requests_resume_exactly_and_the_unit_serves_again(unit, temperatures):
    """Sampled rows are compared alone: their twin in a batch of other shapes may differ by a float rounding of the
    batched forward (no kernel here is batch-invariant), which a resume cannot cause or prevent."""
    coord, local = unit
    reqs = [_req("speculative", n=300, seed=i + 1, temperature=t) for i, t in enumerate(temperatures)]
    want = [local.generate(r).token_ids for r in reqs]
    steps_before = coord.engine.steps
    threads, results = _run_concurrently(coord, reqs)
    _poll(lambda: coord.engine.steps >= steps_before + 2, "the requests to be decoding")
    old = _pid(coord, "target")
    os.kill(old, signal.SIGKILL)
    t_kill = time.perf_counter()
    _poll(lambda: not coord.ready, "health to say NOT_SERVING", timeout=10)
    _poll(lambda: "target" in coord.engine.health.down, "the watchdog to mark the target down", timeout=10)
    coord.health()          # Serve's replica check passes while Ray restarts it: the unit is not replaced
    for t in threads:
        t.join(DEADLINE_S)
    done_in = time.perf_counter() - t_kill
    assert not any(isinstance(r, BaseException) for r in results), results
    assert [r.token_ids for r in results] == want            # resumed from what they emitted: exactly the twins
    assert _pid(coord, "target") != old and coord.ready
    got = coord.generate_blocking(_req("speculative", seed=5), timeout=DEADLINE_S)
    assert got.token_ids == local.generate(_req("autoregressive", seed=5)).token_ids
    print(f"\ntarget killed: {len(reqs)} in-flight request(s) resumed and completed {done_in:.1f}s after the kill")
    assert not any(ids for ids in coord.active_requests().values())


def test_without_resuming_a_dead_target_fails_its_requests_fast(unit):
    coord, _ = unit
    coord.engine.resume_limit, limit = 0, coord.engine.resume_limit
    try:
        steps_before = coord.engine.steps
        threads, results = _run_concurrently(coord, [_req("speculative", n=400, seed=i) for i in range(2)])
        _poll(lambda: coord.engine.steps >= steps_before + 2, "the requests to be decoding")
        old = _pid(coord, "target")
        os.kill(old, signal.SIGKILL)
        t_kill = time.perf_counter()
        for t in threads:
            t.join(DEADLINE_S)
        failed_in = time.perf_counter() - t_kill
        assert all(isinstance(r, ModelUnavailableError) for r in results), results
        assert "retry" in str(results[0]) and "Traceback" not in str(results[0])
        assert failed_in < 15.0
        _poll(lambda: coord.ready and _pid(coord, "target") != old, "the target to be back")
    finally:
        coord.engine.resume_limit = limit
    print(f"\ntarget killed, resume_limit 0: in-flight requests failed with UNAVAILABLE after {failed_in:.1f}s")
    assert not any(ids for ids in coord.active_requests().values())


@pytest.mark.slow      # ~30 s (a TP = 2 unit of its own); the slow suite's
def test_dead_tensor_parallel_rank_rebuilds_the_group(unit, tmp_path):
    """Killing one rank of a TP=2 target: health says NOT_SERVING, the unit kills the rest of the group, starts a
    new one, and the in-flight requests resume on it, each equal to its uninterrupted twin."""
    from cluster.config.schema import config_from_dict
    from cluster.serving.control.coordinator import Coordinator
    from tests.support.checkpoints import write_tiny_checkpoints
    cfg = config_from_dict({"models": write_tiny_checkpoints(tmp_path),
                            "cluster": {"tp_size": 2, "backend": "gloo", "target": {"num_cpus": 0.1},
                                        "drafters": {"num_cpus": 0.1}, "call_timeout_s": 10.0}})
    coord = Coordinator(cfg)
    try:
        coord.warmup(2)
        local = engine_for(cfg)
        want = local.generate(_req("speculative", n=24, seed=3, drafter="drafter")).token_ids
        reqs = [_req("speculative", n=200, seed=i, drafter="drafter") for i in range(2)]
        twins = [local.generate(r).token_ids for r in reqs]
        old = coord.entries["target"].handle.channel.actors
        rank1 = ray.get(old[1].__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        steps_before = coord.engine.steps
        threads, results = _run_concurrently(coord, reqs)
        _poll(lambda: coord.engine.steps >= steps_before + 2, "the requests to be decoding")
        os.kill(rank1, signal.SIGKILL)
        t_kill = time.perf_counter()
        _poll(lambda: not coord.ready, "health to say NOT_SERVING", timeout=10)
        not_serving_in = time.perf_counter() - t_kill
        for t in threads:
            t.join(DEADLINE_S)
        done_in = time.perf_counter() - t_kill
        assert [getattr(r, "token_ids", r) for r in results] == twins      # resumed on the new group, exactly
        _poll(lambda: coord.ready, "the rebuilt group to serve")
        recovered_in = time.perf_counter() - t_kill
        new = coord.entries["target"].handle.channel.actors
        assert len(new) == 2 and not set(map(id, new)) & set(map(id, old))     # a whole new group
        got = coord.generate_blocking(_req("speculative", n=24, seed=3, drafter="drafter"), timeout=DEADLINE_S)
        assert got.token_ids == want
        print(f"\nTP rank killed: NOT_SERVING after {not_serving_in:.1f}s, in-flight requests resumed and done "
              f"after {done_in:.1f}s, group rebuilt and serving after {recovered_in:.1f}s")
        assert not any(ids for ids in coord.active_requests().values())
    finally:
        coord.shutdown()
