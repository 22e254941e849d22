"""The one request path of every front: a front's fields -> a validated, tokenized :class:`PreparedRequest`.

gRPC (:func:`cluster.serving.fronts.grpc_api.fields_from_proto`), HTTP completions and chat
(:mod:`cluster.serving.fronts.http_api`, :mod:`cluster.serving.fronts.chat_completions`) and the CLI only translate their own message
into :class:`Fields`; here the config's ``generation`` defaults are merged, chat messages are rendered with
the checkpoint's template, and the engine validates and tokenizes the request once (``Engine.prepare``).
:func:`admit` does the blocking part (tokenizing, rendering) in a worker thread, off the event loop.
A refusal names the front's own parameter (``max_tokens`` on HTTP, ``max_new_tokens`` on gRPC).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from cluster.config.schema import Config
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest, PreparedRequest
from cluster.errors import ParamError
from cluster.models.chat_template import render_chat
from cluster.serving.ops.error_table import UnknownModel


@dataclass
class Fields:
    """A front's request as the client sent it; ``None`` leaves a field to the server config's default."""

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: Any = None                   # chat: [{role, content}], rendered with the model's chat template
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    strategy: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    ignore_eos: bool = False
    request_id: str | None = None
    model: str | None = None               # None: the served one
    logprobs: int | None = None            # top-n per emitted token (None: none)
    prompt_logprobs: int | None = None     # top-n per prompt token (None: none)
    structured: Any = None                 # tools / tool_choice / response_format (serving/fronts/structured.py)
    names: dict[str, str] = field(default_factory=dict)   # engine parameter -> the front's name for it
    prediction: str | None = None          # predicted output text (OpenAI's prediction.content)
    template_kwargs: dict | None = None    # chat: extra chat-template variables (chat_template_kwargs)
    cache_salt: str | None = None          # vLLM's cache_salt (None: no salt)
    resume_ids: list[int] | None = None    # a continuation: the tokens an earlier run of the request emitted


def build_request(cfg: Config, f: Fields, tokenizer=None) -> GenerationRequest:
    """The GenerationRequest of ``f`` over ``cfg``'s defaults (``tokenizer``: to render ``messages``).  Only
    what the engine cannot know is checked here: the served model name and that a SpecDec++ head is a served
    drafter's (a client never names a file: see :mod:`cluster.strategies.specdec_pp`)."""
    if f.model is not None and f.model != cfg.cluster.app_name:
        raise UnknownModel(f.model, cfg.cluster.app_name)
    head = f.options.get("head") if isinstance(f.options, dict) else None
    if head is not None and head not in cfg.drafters:
        raise ParamError("head", "the name of a served drafter (whose acceptance head is built): one of "
                         + ", ".join(cfg.drafters), head)
    prompt = f.prompt
    if f.messages is not None:
        if f.prompt or f.prompt_ids:
            raise ParamError("messages", "unset when a prompt is given (one of prompt, prompt_ids, messages)",
                             f.messages)
        prompt = render_chat(tokenizer, f.messages, template_kwargs=f.template_kwargs,
                             tools=f.structured.tools if f.structured else None)
    elif f.template_kwargs:
        raise ParamError("chat_template_kwargs", "unset unless messages are given", f.template_kwargs)
    grammar = f.structured.compile(tokenizer, cfg.chat.tool_parser) if f.structured is not None else None
    gen = cfg.generation
    sampling = SamplingParams(temperature=_or(f.temperature, gen.temperature), top_p=_or(f.top_p, gen.top_p),
                              top_k=_or(f.top_k, gen.top_k))
    return GenerationRequest(prompt=prompt, prompt_ids=f.prompt_ids, sampling=sampling, seed=f.seed,
                             max_new_tokens=_or(f.max_new_tokens, gen.max_new_tokens), stop=tuple(f.stop),
                             strategy=f.strategy, options=dict(f.options), ignore_eos=f.ignore_eos,
                             request_id=f.request_id, logprobs=f.logprobs, prompt_logprobs=f.prompt_logprobs,
                             prediction=f.prediction, grammar=grammar, cache_salt=f.cache_salt,
                             resume_ids=f.resume_ids)


def prepare(coord, cfg: Config, f: Fields) -> PreparedRequest:
    """Build, validate and tokenize through ``coord.prepare`` (the engine's; blocking).  A
    refusal of a rendered chat prompt names ``messages``."""
    try:
        tokenizer = coord.engine.tokenizer if f.messages is not None or f.structured is not None else None
        return coord.prepare(build_request(cfg, f, tokenizer))
    except ParamError as e:
        name = "messages" if f.messages is not None and e.name == "prompt" else \
            "resume_token_ids" if e.name == "resume_ids" else f.names.get(e.name)
        if name is None:
            raise
        raise ParamError(name, e.allowed, e.value) from None


async def admit(coord, cfg: Config, f: Fields) -> PreparedRequest:
    """:func:`prepare` on a worker thread (tokenizing a long prompt must not stall the replica's event loop)."""
    return await asyncio.to_thread(prepare, coord, cfg, f)


def _or(value, default):
    return default if value is None else value
