"""The Max-Gram drafter (:class:`cluster.models.maxgram.MagHandle`; Chen et al., *Cascade Speculative
Drafting for Even Faster LLM Inference*, section 3.3) as a Ray actor.

Used by the ``separated`` topology so every model of a unit is its own actor; in the ``default``
topology MaG runs inside the coordinator (it costs microseconds, less than any round trip).  Same
call protocol as :class:`actors.model_actor.ModelHost`; its handle declares itself
``deterministic`` (one-hot proposals), which is how CS Drafting recognises the statistical drafter.
"""
from __future__ import annotations

from actors.model_actor import MAX_RESTARTS, ModelHost
from cluster.models.build import build_handle


class MagHost(ModelHost):
    def __init__(self, cfg, name: str, vocab_size: int):     # super().__init__ not called: it builds a neural model
        self.worker = build_handle(cfg, name, vocab_size=vocab_size)
        self.name = name


def start_mag_actor(cfg, vocab_size: int, *, num_cpus: float):
    import ray
    return ray.remote(MagHost).options(num_cpus=num_cpus, max_concurrency=2, max_restarts=MAX_RESTARTS).remote(
        cfg, cfg.mag.name, vocab_size)
