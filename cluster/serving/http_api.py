"""The OpenAI-compatible ``/v1/completions`` request parsing and response/error shapes.

The body is read up to MAX_MESSAGE_BYTES (the declared ``Content-Length`` first), its JSON nesting is
checked (at most MAX_JSON_DEPTH levels) before it is parsed, and every field's type and size before it is
used; each refusal is a :class:`ParamError` (HTTP 400 naming the field, the allowed range and the value).
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from cluster.config.schema import Config
from cluster.core.sampling import SamplingParams
from cluster.engine.request import (
    MAX_JSON_DEPTH,
    MAX_MESSAGE_BYTES,
    MAX_PROMPT_IDS,
    GenerationRequest,
)
from cluster.errors import ParamError, check_int
from cluster.serving.grpc_api import _request
from cluster.strategies import REGISTRY

_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")        # opening +1, closing -1 (after subtracting 1)


async def read_body(request, limit: int = MAX_MESSAGE_BYTES) -> bytes:
    """The request body (a Starlette request), refused once it is known to exceed ``limit`` bytes."""
    allowed = f"a JSON object of at most {limit} bytes"
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
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


def request_from_openai(body: Any, cfg: Config) -> tuple[GenerationRequest, bool]:
    """(request, stream) from an OpenAI completions body (extensions: top_k, strategy, options,
    ignore_eos). Unset sampling fields take the server config's defaults."""
    if not isinstance(body, dict):
        raise ParamError("body", "a JSON object", type(body).__name__)
    prompt = body.get("prompt")
    text, ids = None, None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                      # a batch of one
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and len(prompt) > MAX_PROMPT_IDS:
        raise ParamError("prompt", f"at most {MAX_PROMPT_IDS} token ids", f"{len(prompt)} token ids")
    elif isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        ids = prompt
    else:
        raise ParamError("prompt", "a string or a list of token ids (one prompt per request)", prompt)
    n = body.get("n", 1)
    if n != 1:
        raise ParamError("n", "1 (one completion per request)", n)
    for name in ("echo", "logprobs", "suffix"):
        if body.get(name) not in (None, False):
            raise ParamError(name, "unset (not supported)", body.get(name))
    if body.get("best_of") not in (None, 1):
        raise ParamError("best_of", "1 or unset", body.get("best_of"))
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)):
        raise ParamError("stop", "a string or a list of strings", stop)
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ParamError("options", "an object of strategy options", options)
    strategy = body.get("strategy")
    if strategy is not None and not isinstance(strategy, str):
        raise ParamError("strategy", "one of " + ", ".join(sorted(REGISTRY)), strategy)
    gen = cfg.generation
    sampling = SamplingParams(temperature=_get(body, "temperature", gen.temperature),
                              top_p=_get(body, "top_p", gen.top_p), top_k=_get(body, "top_k", gen.top_k))
    max_tokens = check_int("max_tokens", _get(body, "max_tokens", gen.max_new_tokens), 1,
                           cfg.engine.max_new_tokens_limit)
    req = _request(cfg, prompt=text, prompt_ids=ids, max_new_tokens=max_tokens,
                   sampling=sampling, seed=body.get("seed"), stop=tuple(stop), strategy=strategy,
                   options=options, ignore_eos=bool(body.get("ignore_eos", False)), request_id=None)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ParamError("stream", "true or false", stream)
    return req, stream


def _get(body: dict, key: str, default):
    v = body.get(key)
    return default if v is None else v


def _openai_finish(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def _oai_error(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
