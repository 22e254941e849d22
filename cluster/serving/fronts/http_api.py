"""The OpenAI-compatible HTTP bodies: reading and parsing them, and the error and model-list shapes.

The body is read up to MAX_MESSAGE_BYTES (the declared ``Content-Length`` first) and its JSON nesting is
checked (at most MAX_JSON_DEPTH levels) before it is parsed; then the endpoint's request model
(:mod:`cluster.serving.fronts.completions`, :mod:`cluster.serving.fronts.chat_completions`: pydantic, strict types, unknown parameters
forbidden) types it and the engine validates the ranges.  Every refusal is a
:class:`ParamError` (HTTP 400 naming the parameter, the allowed range and the value); a ``model`` other than
the served one is :class:`cluster.serving.ops.error_table.UnknownModel` (HTTP 404, as vLLM answers).
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from cluster.engine.request import MAX_JSON_DEPTH, MAX_MESSAGE_BYTES
from cluster.errors import ParamError

_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")        # opening +1, closing -1 (after subtracting 1)
DRAIN_FACTOR = 4        # an oversized body up to this many limits is read (and dropped) before it is refused


async def read_body(request, limit: int = MAX_MESSAGE_BYTES, drain: int = DRAIN_FACTOR) -> bytes:
    """The request body (a Starlette request), refused once it is known to exceed ``limit`` bytes.  A body up
    to ``drain`` times the limit is read to its end (and dropped) before the refusal, so the client, still
    sending, gets the 400 instead of a connection reset; a larger one is refused at once."""
    allowed = f"a JSON object of at most {limit} bytes"
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        if int(declared) <= drain * limit:
            async for _ in request.stream():
                pass
        raise ParamError("body", allowed, f"{int(declared)} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ParamError("body", allowed, f"more than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes) -> Any:
    """JSON from ``raw``, nested at most MAX_JSON_DEPTH levels: the depth is measured before parsing (the
    running sum over the brackets outside strings, vectorised), so deep nesting costs no recursion."""
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:                 # else it cannot nest deeper
        unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")    # now each '"' opens or closes a string
        steps = b"".join(unescaped.split(b'"')[::2]).translate(_STEPS, _NOT_BRACKET)
        if steps and int(np.cumsum(np.frombuffer(steps, np.uint8).astype(np.int32) - 1).max()) > MAX_JSON_DEPTH:
            raise ParamError("body", f"JSON nested at most {MAX_JSON_DEPTH} levels", "deeper nesting")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):   # UnicodeDecodeError is a ValueError
        raise ParamError("body", "a JSON object", "invalid JSON") from None


# -- responses -------------------------------------------------------------------------------------
def oai_error(message: str, kind: str, param: str | None = None, code: int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "specserve", "root": model}]}
