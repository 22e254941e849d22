"""The Max-Gram drafter (:class:`cluster.mag.MagHandle`, paper 002 section 3.3) as a Ray actor.

Used by the ``separated`` topology so every model of a unit is its own actor; in the ``default``
topology MaG runs inside the coordinator (it costs microseconds, less than any round trip).  Same
call protocol as :class:`actors.model_actor.ModelHost`; ``info()["is_mag"]`` lets strategies that
treat the statistical drafter specially (CS Drafting) recognise the remote handle.
"""
from __future__ import annotations

from .model_actor import ModelHost


class MagHost(ModelHost):
    def __init__(self, cfg, name: str, vocab_size: int, threads: int = 1):     # noqa: super deferred
        from cluster.loader import load_tokenizer
        from cluster.mag import MagHandle, bigram_for
        tokenizer = load_tokenizer(cfg)
        self.worker = MagHandle(vocab_size, bigram_for(cfg, tokenizer, vocab_size), name=name,
                                max_ngram=cfg.mag.max_ngram)
        self.name = name

    def info(self) -> dict:
        return dict(super().info(), is_mag=True)


def start_mag_actor(cfg, vocab_size: int, *, num_cpus: float, concurrency: int = 4):
    import ray
    return ray.remote(MagHost).options(num_cpus=num_cpus, max_concurrency=concurrency).remote(
        cfg, cfg.mag.name, vocab_size)
