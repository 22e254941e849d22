"""The engine: requests in, tokens out (admission, the step loop, stop rules, streaming)."""
from __future__ import annotations

from cluster.engine.engine import Engine
from cluster.engine.request import (
    GenerationRequest,
    GenerationResult,
    PreparedRequest,
    StreamChunk,
)

__all__ = ["Engine", "GenerationRequest", "GenerationResult", "PreparedRequest", "StreamChunk"]
