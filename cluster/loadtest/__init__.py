"""``specserve loadtest``: open-loop (Poisson) and closed-loop (concurrency) load against a running cluster,
over gRPC and HTTP, reported per stage like ``vllm bench serve`` (see docs/operator-guide.md, "Load tests").

The load comes from locust, headless, in a child process (:mod:`cluster.loadtest.worker`: locust
monkey-patches the process it runs in, so nothing here imports it); this package's other modules need no
locust and no Ray and can be used from any process.
"""
from __future__ import annotations

from cluster.loadtest.checks import LoadTestError
from cluster.loadtest.clients import Target
from cluster.loadtest.replicas import connect_ray, serve_replicas
from cluster.loadtest.run import LoadResult, run_loadtest
from cluster.loadtest.spec import (
    LoadSpec,
    RequestSpec,
    Stage,
    load_spec,
    parse_stages,
    spec_from_dict,
)

__all__ = ["LoadResult", "LoadSpec", "LoadTestError", "RequestSpec", "Stage", "Target", "connect_ray", "load_spec",
           "parse_stages", "run_loadtest", "serve_replicas", "spec_from_dict"]
