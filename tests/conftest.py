import dataclasses
import socket

import pytest
import torch

from cluster.config.schema import MagSpec, load_config
from cluster.family import ensure_built
from tests.support.built import engine_for

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_engine():
    """The in-process engine over configs/tiny.yaml (random tiny target and two truncated drafters)."""
    cfg = load_config("configs/tiny.yaml")
    return engine_for(cfg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def served():
    """A local Ray and the Serve app on configs/tiny.yaml plus the Max-Gram drafter, with real gRPC and HTTP ports
    on free ports: one per test session (start-up dominates), shared by tests/serving and tests/loadtest."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from cluster.serving.fronts.app import start_serve
    from cluster.serving.client.sdk import SpecServeClient
    cfg = load_config("configs/tiny.yaml")
    cfg = dataclasses.replace(cfg, mag=MagSpec(), cluster=dataclasses.replace(cfg.cluster, grpc_port=_free_port(),
                                                                              http_port=_free_port()))
    ensure_built(cfg, progress=False)           # the Max-Gram bigram table (strategies mag and cs_drafting with it)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, namespace="specserve-test", log_to_driver=False)
    start_serve(cfg)
    client = SpecServeClient(f"127.0.0.1:{cfg.cluster.grpc_port}", app=cfg.cluster.app_name, timeout=120)
    client.wait_ready(300)
    yield cfg, client
    client.close()
    serve.shutdown()
    if started_ray:
        ray.shutdown()
