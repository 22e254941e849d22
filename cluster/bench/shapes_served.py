"""The shapes suite's served column (:mod:`cluster.bench.shapes`): the same checkpoints and requests through
Ray Serve's gRPC proxy, colocated, under each sampler.

For each vocabulary the Serve application of :func:`cluster.bench.shapes.config_for` is started once per
sampler on free 127.0.0.1 ports (a local Ray unless the caller started one; Serve shut down after each, on
errors too), and every cell of the largest row count is sent as that many concurrent unary requests, the
in-process cell's prompts and seeds, one untimed request first.  Per cell: served output tokens/s under each
sampler, their ratio, and whether every output equals the in-process one of the same sampler (every draw is a
function of the request's seed and position, so a batch formed by arrival yields the same tokens).
"""
from __future__ import annotations

from pathlib import Path

from cluster.bench.served import READY_TIMEOUT_S, REQUEST_TIMEOUT_S, WARMUP_TOKENS, served_config
from cluster.bench.served_cells import served_cell


def served_cells(path: Path, root: Path, rows: int, cells: list[tuple[float, str]], samplers, prompts,
                 new_tokens: int, options: dict, first_seed: int) -> dict:
    """``cells``: (temperature, strategy) at ``rows`` concurrent requests -> {(sampler, T, strategy):
    {"tok_s", "tokens", "failures"}}."""
    import ray
    from ray import serve

    from cluster.bench.shapes import config_for
    from cluster.serving.client.sdk import SpecServeClient
    from cluster.serving.fronts.app import start_serve

    out: dict = {}
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, namespace="specserve-bench")
    try:
        for sampler in samplers:
            scfg = served_config(config_for(path, sampler, rows, root), "colocated")
            client = None
            try:
                start_serve(scfg)
                client = SpecServeClient(f"127.0.0.1:{scfg.cluster.grpc_port}", app=scfg.cluster.app_name,
                                         timeout=REQUEST_TIMEOUT_S, api_key="")
                client.wait_ready(READY_TIMEOUT_S)
                served_cell(client, prompts, 1, 1, WARMUP_TOKENS, "speculative", options, stream=False,
                            temperature=1.0)
                for T, strategy in cells:
                    recs, secs = served_cell(client, prompts[:rows], rows, rows, new_tokens, strategy,
                                             options if strategy == "speculative" else {}, first_seed=first_seed,
                                             stream=False, temperature=T)
                    ok = [r for r in recs if r.error is None]
                    out[(sampler, T, strategy)] = {
                        "tok_s": sum(len(r.token_ids) for r in ok) / secs if secs else 0.0,
                        "tokens": [r.token_ids if r.error is None else None for r in recs],
                        "failures": len(recs) - len(ok)}
            finally:
                if client is not None:
                    client.close()
                try:
                    serve.shutdown()
                except Exception as e:       # noqa: BLE001 - still go on; say what failed
                    print(f"[bench shapes: serve.shutdown() failed: {type(e).__name__}: {e}]")
    finally:
        if started_ray:
            ray.shutdown()
    return out
