"""Per-step cost of a unit's draft side, measured where a Serve replica runs it (run in a Ray actor by
tests/serving/test_multinode.py): the coordinator's engine over the config's actors, greedy requests, and the
draft-side handle's round trips (caller wall time, actor compute, result bytes)."""
from __future__ import annotations

import time

from cluster.config.schema import config_from_dict
from cluster.core.draft.programs import DRAFTS
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.serving.control.coordinator import Coordinator


class StepProbe:
    def run(self, cfg_dict: dict, prompts: list[list[int]], max_new: int) -> dict:
        import ray
        cfg = config_from_dict(cfg_dict)
        coord = Coordinator(cfg)
        try:
            coord.warmup()
            coord.reset_timings()
            steps, t0, outs = 0, time.perf_counter(), []
            for ids in prompts:
                res = coord.generate_blocking(GenerationRequest(prompt_ids=list(ids), max_new_tokens=max_new,
                                                                sampling=SamplingParams(0.0), strategy="speculative"))
                steps += res.stats.target_forwards
                outs.append(list(res.token_ids))
            wall = time.perf_counter() - t0
            t = coord.timings()[DRAFTS]
            return {"node": ray.util.get_node_ip_address(), "steps": steps, "step_ms": 1e3 * wall / steps,
                    "calls": t.calls, "rtt_ms": 1e3 * t.wall_s / t.calls, "rpc_ms": 1e3 * t.rpc_s / t.calls,
                    "bytes_per_call": t.bytes_in / t.calls, "outputs": outs}
        finally:
            coord.shutdown()
