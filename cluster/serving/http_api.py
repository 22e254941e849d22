"""The OpenAI-compatible ``/v1/completions`` request model, its parsing, and the response / error shapes.

The body is read up to MAX_MESSAGE_BYTES (the declared ``Content-Length`` first) and its JSON nesting is
checked (at most MAX_JSON_DEPTH levels) before it is parsed; then :class:`CompletionRequest` (pydantic, strict
types, unknown parameters forbidden) types it and the engine validates the ranges.  Every refusal is a
:class:`ParamError` (HTTP 400 naming the parameter, the allowed range and the value); a ``model`` other than
the served one is :class:`cluster.serving.error_table.UnknownModel` (HTTP 404, as vLLM answers).
"""
from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from cluster.engine.request import (
    MAX_JSON_DEPTH,
    MAX_MESSAGE_BYTES,
    MAX_PROMPT_IDS,
    GenerationResult,
)
from cluster.errors import ParamError, shown
from cluster.serving.requests import Fields
from cluster.strategies import REGISTRY

_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")        # opening +1, closing -1 (after subtracting 1)
# OpenAI parameters served only at the value that turns them off: anything else is refused, never ignored
OFF = {"n": (1,), "best_of": (None, 1), "echo": (None, False), "logprobs": (None,), "suffix": (None, ""),
       "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
       "stream_options": (None,)}


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


class CompletionRequest(BaseModel):
    """``POST /v1/completions``: OpenAI's completions parameters plus the extensions ``top_k``, ``strategy``,
    ``options`` and ``ignore_eos``.  Each field's description is the allowed range a refusal names."""
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="the served model id (GET /v1/models)")
    prompt: str | list[int] = Field(description="a string or a list of token ids (one prompt per request)")
    max_tokens: int | None = Field(None, description="an integer >= 1 (default: the server's max_new_tokens)")
    temperature: float | None = Field(None, description="a number >= 0 (0 = greedy)")
    top_p: float | None = Field(None, description="a number in (0.0, 1.0]")
    top_k: int | None = Field(None, description="an integer >= 0 (0 = off)")
    seed: int | None = Field(None, description="an integer")
    stop: str | list[str] | None = Field(None, description="a string or a list of strings")
    stream: bool = Field(False, description="true or false")
    user: str | None = Field(None, description="a string (an end-user id; accepted, not used)")
    n: int = Field(1, description="1 (one completion per request)")
    best_of: int | None = Field(None, description="1 or unset (not supported)")
    echo: bool | None = Field(None, description="false or unset (not supported)")
    logprobs: int | None = Field(None, description="unset (not supported)")
    suffix: str | None = Field(None, description="unset (not supported)")
    presence_penalty: float | None = Field(None, description="0 or unset (not supported)")
    frequency_penalty: float | None = Field(None, description="0 or unset (not supported)")
    logit_bias: dict[str, float] | None = Field(None, description="{} or unset (not supported)")
    stream_options: dict[str, Any] | None = Field(None, description="unset (not supported)")
    strategy: str | None = Field(None, description="one of " + ", ".join(sorted(REGISTRY)))
    options: dict[str, Any] | None = Field(None, description="an object of strategy options")
    ignore_eos: bool = Field(False, description="true or false")

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]                                                     # a batch of one
        if isinstance(v, list) and len(v) > MAX_PROMPT_IDS:
            raise ParamError("prompt", f"at most {MAX_PROMPT_IDS} token ids", f"{len(v)} token ids")
        if isinstance(v, str) or (isinstance(v, list) and all(type(i) is int for i in v)):
            return v
        raise ParamError("prompt", cls.model_fields["prompt"].description, v)

    @model_validator(mode="after")
    def _served_off(self) -> "CompletionRequest":
        for name, off in OFF.items():
            value = getattr(self, name)
            if not any(value == o and type(value) is type(o) for o in off):
                raise ParamError(name, type(self).model_fields[name].description, value)
        return self

    @classmethod
    def from_body(cls, body: Any) -> "CompletionRequest":
        """Typed from a parsed JSON body; the first problem as a ParamError naming its parameter (an unknown
        one by its name, shown escaped and cut when it is not a plain identifier)."""
        if not isinstance(body, dict):
            raise ParamError("body", "a JSON object", body)
        for key in body:
            if key not in cls.model_fields:
                name = key if key.isidentifier() and len(key) <= 64 else shown(key, 64)
                raise ParamError(name, "unset: not a parameter of /v1/completions (its parameters: "
                                 + ", ".join(cls.model_fields) + ")", body[key])
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            if isinstance(err.get("ctx", {}).get("error"), ParamError):
                raise err["ctx"]["error"] from None
            name = str(err["loc"][0]) if err["loc"] else "body"
            value = None if err["type"] == "missing" else err["input"]
            allowed = cls.model_fields[name].description if name in cls.model_fields else "a JSON object"
            raise ParamError(name, allowed, value) from None


HTTP_NAMES = {"max_new_tokens": "max_tokens"}    # the engine's parameter -> the name OpenAI clients send


def fields_from_openai(body: Any) -> tuple[Fields, CompletionRequest]:
    """The request's fields from an OpenAI completions body, and the typed body (for the response's shape).
    :mod:`cluster.serving.requests` merges the config's defaults; the engine checks the ranges."""
    m = CompletionRequest.from_body(body)
    text, ids = (m.prompt, None) if isinstance(m.prompt, str) else (None, m.prompt)
    stop = (m.stop,) if isinstance(m.stop, str) else tuple(m.stop or ())
    return Fields(prompt=text, prompt_ids=ids, max_new_tokens=m.max_tokens, temperature=m.temperature,
                  top_p=m.top_p, top_k=m.top_k, seed=m.seed, stop=stop, strategy=m.strategy,
                  options=m.options or {}, ignore_eos=m.ignore_eos, model=m.model, names=HTTP_NAMES), m


# -- responses -------------------------------------------------------------------------------------
def openai_finish(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def oai_error(message: str, kind: str, param: str | None = None, code: int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def completion(model: str, r: GenerationResult | None, text: str, finish: str | None, *, usage: bool,
               rid: str | None = None) -> dict:
    """A completion (or, streaming, one chunk of it); the final one carries usage and our ``specserve``
    field (token ids, seed, finish reason, statistics)."""
    out = {"id": "cmpl-" + (r.request_id if r else rid or ""), "object": "text_completion",
           "created": int(time.time()), "model": model,
           "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": openai_finish(finish)}]}
    if usage and r is not None:
        out["usage"] = {"prompt_tokens": r.stats.prompt_tokens, "completion_tokens": r.stats.generated_tokens,
                        "total_tokens": r.stats.prompt_tokens + r.stats.generated_tokens}
        out["specserve"] = {"token_ids": r.token_ids, "seed": r.seed, "finish_reason": r.finish_reason,
                            "stats": r.stats.to_dict()}
    return out


def model_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "specserve", "root": model}]}
