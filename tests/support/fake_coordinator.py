"""The coordinator's surface the fronts use (validate, stream, generate, engine, metrics, ready), over the
in-process engine on configs/tiny.yaml: the HTTP app and its routes run without Ray, and validation messages
are the engine's own.  ``fail_with`` / ``fail_after_first`` inject an error at admission / after one chunk."""
from __future__ import annotations

from types import SimpleNamespace

from cluster.config.schema import load_config
from cluster.serving.ops.auth import Keys
from cluster.serving.fronts.http_app import build_http_app

CFG = load_config("configs/tiny.yaml")


class Recorder:
    """Metrics stand-in: the (strategy, outcome) of every record."""

    def __init__(self):
        self.records = []

    def record(self, strategy, outcome, *a, **kw):
        self.records.append((strategy, outcome))


class EngineCoordinator:
    def __init__(self, engine):
        self.engine, self.ready, self.metrics = engine, True, Recorder()
        self.fail_with = None           # raised at admission
        self.fail_after_first = None    # raised after the first chunk

    def prepare(self, req):
        return self.engine.prepare(req)

    async def stream(self, req):
        if self.fail_with is not None:
            raise self.fail_with
        for i, chunk in enumerate(self.engine.stream(req)):
            if i == 1 and self.fail_after_first is not None:
                raise self.fail_after_first
            yield chunk

    async def generate(self, req):
        async for chunk in self.stream(req):
            if chunk.result is not None:
                return chunk.result


def http_app(engine, cfg=CFG):
    """(the replica's FastAPI app, its deployment stand-in) over ``engine``."""
    dep = SimpleNamespace(cfg=cfg, keys=Keys(), coord=EngineCoordinator(engine))
    return build_http_app(dep), dep
