"""Soak: 1,000 mixed requests through one serving unit (local Ray, configs/tiny.yaml, every model an actor).

Outcomes mixed on purpose: ok (several strategies, greedy and sampled), cancelled (the client stops reading
after its first chunk), invalid (refused at admission), overloaded (bursts past max_batch + max_queue) and
deadline (long requests under a short server-side deadline).  Afterwards no request state remains on any
actor, and the resident memory of the unit's processes is within 10% of where it was after warm-up.

Slow (a few minutes on 2 cores): not in the default run.  Run it with
    .venv/bin/python -m pytest -m slow tests/serving/test_soak.py -s
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from collections import Counter

import pytest

from cluster.config.schema import MagSpec, load_config
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import DeadlineExceededError, OverloadedError, ParamError
from tests.support.built import engine_for

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow

TOTAL, WARMUP = 1000, 200
PROMPT = [ord(c) for c in "def fib(n):\n    return"]


def _request(i: int, rng: random.Random) -> tuple[str, GenerationRequest]:
    kind = rng.choices(["ok", "cancel", "invalid", "deadline"], weights=[6, 2, 1, 1])[0]
    strategy = rng.choice(["autoregressive", "speculative", "mag", "cs_drafting", "spec_cascade"])
    sampling = SamplingParams(rng.choice([0.0, 0.8]))
    if kind == "invalid":
        return kind, GenerationRequest(prompt_ids=PROMPT, max_new_tokens=rng.choice([0, 10**6]), strategy=strategy)
    n = 512 if kind == "deadline" else rng.randint(4, 16)      # 512: the tiny config's max_new_tokens_limit
    return kind, GenerationRequest(prompt_ids=PROMPT[:rng.randint(3, len(PROMPT))], max_new_tokens=n,
                                   sampling=sampling, seed=i, strategy=strategy, ignore_eos=True)


async def _one(coord, kind, req) -> str:
    try:
        async for chunk in coord.stream(req):
            if kind == "cancel":
                return "cancelled"                # leaving the loop closes the stream: the request is aborted
            if chunk.result is not None:
                return "ok"
    except ParamError:
        return "invalid"
    except OverloadedError:
        return "overloaded"
    except DeadlineExceededError:
        return "deadline"
    return "cancelled"


def _rss(coord) -> int:
    pids = {os.getpid()}
    for e in coord.entries.values():
        if e.placement != "local":
            pids.add(ray.get(e.handle.channel.actors[0].__ray_call__.remote(lambda self: os.getpid())))
    return sum(psutil.Process(p).memory_info().rss for p in pids)


def test_soak_mixed_requests_leave_no_state_and_no_growth():
    from cluster.serving.control.coordinator import Coordinator
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, namespace="specserve-test", log_to_driver=False)
    cfg = load_config("configs/tiny.yaml")
    cfg = dataclasses.replace(
        cfg, mag=MagSpec(), engine=dataclasses.replace(cfg.engine, request_timeout_s=1.0),
        cluster=dataclasses.replace(cfg.cluster, target_placement="actor"))
    engine_for(cfg)                                # builds the bigram table (entry point)
    coord = Coordinator(cfg)
    coord.warmup(2)
    rng = random.Random(0)
    outcomes: Counter = Counter()
    rss = {}

    async def drive():
        i = 0
        while i < TOTAL:
            burst = rng.choice([1, 4, 12, 24])         # 24 > max_batch + max_queue: some are refused
            reqs = [_request(i + j, rng) for j in range(min(burst, TOTAL - i))]
            results = await asyncio.gather(*[_one(coord, k, r) for k, r in reqs])
            outcomes.update(results)
            i += len(reqs)
            if i >= WARMUP and "warm" not in rss:
                rss["warm"] = _rss(coord)

    try:
        asyncio.run(drive())
        active = coord.active_requests()
        rss["end"] = _rss(coord)
        print(f"\nsoak: {dict(outcomes)}; unit RSS after warm-up {rss['warm'] / 2**20:.0f} MiB, "
              f"at the end {rss['end'] / 2**20:.0f} MiB ({rss['end'] / rss['warm'] - 1:+.1%})")
        assert sum(outcomes.values()) == TOTAL
        assert {"ok", "cancelled", "invalid", "overloaded", "deadline"} <= set(outcomes), outcomes
        assert not any(ids for ids in active.values()), active
        assert not coord.engine.has_work
        assert rss["end"] <= 1.10 * rss["warm"]
    finally:
        coord.shutdown()
