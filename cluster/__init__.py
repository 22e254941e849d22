"""specserve's public face: the engine, its request types, sampling parameters, configs and the client.

``SpecServeClient`` is loaded on first use, so ``import cluster`` (and ``cluster.core``) needs no gRPC.
"""
from __future__ import annotations

from cluster.config.schema import load_config
from cluster.core.sampling import SamplingParams
from cluster.engine import Engine, GenerationRequest, GenerationResult

__all__ = ["Engine", "GenerationRequest", "GenerationResult", "SamplingParams", "SpecServeClient", "load_config"]


def __getattr__(name: str):
    if name == "SpecServeClient":           # grpc is a heavy dependency: import it only when asked for
        from cluster.serving.client.sdk import SpecServeClient
        return SpecServeClient
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
