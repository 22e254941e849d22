"""The OpenAI-compatible ``/v1/completions`` request parsing and response/error shapes."""
from __future__ import annotations

from typing import Any

from cluster.config.schema import Config
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError, check_int
from cluster.serving.grpc_api import _request
from cluster.strategies import REGISTRY


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
