"""Driving the engine from the caller's thread, one request or a few at a time (the CLI, tests, benchmarks):
each call steps the engine itself until its requests end.  On the cluster a step-loop thread drives it
instead (:class:`cluster.serving.control.coordinator.Coordinator`)."""
from __future__ import annotations

from typing import Iterator

from cluster.engine.request import GenerationRequest, GenerationResult, PreparedRequest, StreamChunk
from cluster.engine.sequence import FINISHED


class CallerDriven:
    """What :class:`cluster.engine.engine.Engine` offers a caller that runs its steps itself (``add``,
    ``step`` and ``abort`` come from the engine)."""

    def generate(self, req: GenerationRequest | PreparedRequest) -> GenerationResult:
        for chunk in self.stream(req):
            pass
        return chunk.result

    def stream(self, req: GenerationRequest | PreparedRequest) -> Iterator[StreamChunk]:
        """Yield one :class:`StreamChunk` per step; the last one carries the :class:`GenerationResult`.
        Closing the iterator cancels the request and releases its state on every model."""
        seq = self.add(req)
        try:
            while True:
                if seq.status != FINISHED:
                    self.step()
                while seq.chunks:
                    yield seq.chunks.pop(0)
                if seq.status == FINISHED:
                    break
            if seq.error is not None:
                raise seq.error
        finally:
            if seq.status != FINISHED:
                self.abort(seq.rid)
                self.step()

    def generate_many(self, reqs: list[GenerationRequest | PreparedRequest]) -> list[GenerationResult]:
        """Run ``reqs`` together (continuous batching within this call); results in order."""
        seqs = [self.add(r) for r in reqs]
        while any(s.status != FINISHED for s in seqs):
            self.step()
        for s in seqs:
            if s.error is not None:
                raise s.error
        return [s.result for s in seqs]
