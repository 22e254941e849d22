"""A Ray actor hosting one model handle (from :func:`cluster.models.build.build_handle`).

The serving unit talks to it through :class:`cluster.serving.control.remote.RemoteHandle`: one ``step`` call per
engine step carries the queued bookkeeping and one batched method for all of the step's requests
(:mod:`actors.protocol`).  Per-step calls are plain Ray actor calls.  Ray Compiled Graphs answer faster, but
their actor-side reader busy-waits: an idle compiled-graph actor burns a whole core, which a unit of three or
four actors on a small CPU box cannot afford.
"""
from __future__ import annotations


from actors.protocol import StepCall, StepTime, apply, stamp
from cluster.models.build import build_handle
from cluster.models.host import setup_process

MAX_RESTARTS = 10      # a model actor that dies is restarted by Ray (empty: its requests re-prefill it)


class ModelHost:
    """The actor body (plain class: :mod:`actors.tp` reuses it)."""

    def __init__(self, cfg, name: str, threads: int = 1):
        setup_process(threads)
        self.worker = build_handle(cfg, name)
        self.name = name

    def info(self) -> dict:
        return self.worker.capabilities()

    def step(self, call: StepCall):
        """-> (packed result of the call's method, :class:`actors.protocol.StepTime`)."""
        t0 = stamp()
        out = apply(self.worker, call)
        t1 = stamp()
        return out, StepTime(t1 - t0, t0, t1)

    def active_requests(self) -> list[str]:
        return self.worker.active_requests()

    def cache_info(self) -> dict:
        return self.worker.cache_info()

    def health(self) -> dict:
        return dict(name=self.name, ok=True, active=len(self.worker.active_requests()))


def start_model_actor(cfg, name: str, *, num_cpus: float, num_gpus: float = 0.0, threads: int = 1, **options):
    """Create the actor for model ``name``; returns the handle (not yet waited on)."""
    import ray
    return ray.remote(ModelHost).options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=2,
                                         max_restarts=MAX_RESTARTS, **options).remote(cfg, name, threads)
