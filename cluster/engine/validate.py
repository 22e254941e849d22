"""Admission: a request is validated and tokenized once, into a :class:`PreparedRequest`.

Every size is checked before any expensive work (tokenizing the prompt, copying token ids, parsing option
values): the limits are the constants of :mod:`cluster.engine.request`; each refusal is a :class:`ParamError`
naming the field, the allowed range and the (truncated) value.
"""
from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

from cluster.core.interfaces import BatchedHandle, Tokenizer
from cluster.core.sampling import MAX_TEMPERATURE, SamplingParams
from cluster.engine.request import (
    MAX_CACHE_SALT,
    MAX_CHARS_PER_TOKEN,
    MAX_OPTION_CELLS,
    MAX_OPTION_NAME,
    MAX_OPTION_VALUE,
    MAX_OPTIONS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_IDS,
    MAX_REQUEST_ID,
    MAX_SEED,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    GenerationRequest,
    PreparedRequest,
)
from cluster.errors import ParamError, check_int, check_text
from cluster.strategies import REGISTRY, check_option_name, resolve_options


def prepare(req: GenerationRequest, models: dict[str, BatchedHandle], tokenizer: Tokenizer, target: str, *,
            default_strategy: str, defaults: dict[str, Any], max_new_tokens_limit: int,
            vocab_size: int) -> PreparedRequest:
    """Validate ``req`` against the served models (raises :class:`ParamError` naming the field, the
    allowed range and the value) and tokenize its prompt; returns the one object that flows down."""
    logprobs = check_top_logprobs("logprobs", req.logprobs)
    prompt_logprobs = check_top_logprobs("prompt_logprobs", req.prompt_logprobs)
    # max_new_tokens = 0 is a prompt-scoring request (OpenAI echo + logprobs, lm-eval's loglikelihood)
    max_new = check_int("max_new_tokens", req.max_new_tokens, 0 if prompt_logprobs is not None else 1,
                        max_new_tokens_limit)
    check_sampling(req.sampling)
    check_request_id(req.request_id)
    name = check_strategy(req.strategy or default_strategy)
    check_options(name, req.options)
    check_stop(req.stop)
    salt = check_cache_salt(req.cache_salt)
    target_len = models[target].max_length
    if req.prompt_ids is not None and len(req.prompt_ids) > 0:
        if len(req.prompt_ids) > min(MAX_PROMPT_IDS, target_len - max_new):     # before reading the ids
            raise _too_long(len(req.prompt_ids), target_len, max_new)
        ids = list(req.prompt_ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
                raise ParamError("prompt_ids", f"token ids in [0, {vocab_size - 1}]", i)
    elif req.prompt:
        ids = tokenizer.encode(check_prompt_text(req.prompt, target_len))
    else:
        raise ParamError("prompt", "non-empty text or token ids", req.prompt or "")
    if not ids:
        raise ParamError("prompt", "text that encodes to at least one token", req.prompt)
    opts = resolve_options(name, req.options, defaults)
    strategy = REGISTRY[name](opts, models, target)
    max_len = strategy.max_length()
    if len(ids) + max_new > max_len:
        raise _too_long(len(ids), max_len, max_new)
    seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "little") & MAX_SEED
    seed = check_int("seed", seed, 0, MAX_SEED)
    prediction = check_prediction(req.prediction, tokenizer, target_len, vocab_size)
    sampling = req.sampling
    if req.grammar is not None:
        if not strategy.constrained:
            raise ParamError(req.grammar.field, "strategies that sample a grammar's law exactly with it: " +
                             ", ".join(sorted(n for n, c in REGISTRY.items() if c.constrained)), f"strategy {name}")
        sampling = dataclasses.replace(sampling, constraint=req.grammar.start(len(ids)))
    resumed = check_resume(req.resume_ids, max_new, vocab_size, None if req.ignore_eos else tokenizer.eos_token_id)
    if resumed and req.seed is None and not sampling.greedy:
        raise ParamError("seed", "the seed of the run it continues (set with resume_ids)", None)
    return PreparedRequest(req.request_id or uuid.uuid4().hex, tuple(ids), max_new, sampling, seed,
                           tuple(req.stop), req.ignore_eos, strategy, logprobs, prompt_logprobs, prediction, salt,
                           resumed)


def _too_long(n: int, max_len: int, max_new: int) -> ParamError:
    return ParamError("prompt", f"at most {max_len - max_new} tokens with max_new_tokens={max_new} "
                      f"(model length {max_len})", f"{n} tokens")


# -- the cheap checks, also used by the servers' parsers before they build a request ------------------
def check_sampling(sampling: SamplingParams) -> None:
    """A positive temperature below MIN_TEMPERATURE (e.g. a subnormal one) would overflow logits / T."""
    t = sampling.temperature
    if 0.0 < t < MIN_TEMPERATURE:
        raise ParamError("temperature", f"0 (greedy) or a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]", t)


def check_top_logprobs(name: str, value: Any) -> int | None:
    """None (no logprobs) or the number of top alternatives per token, in [0, MAX_TOP_LOGPROBS]."""
    return None if value is None else check_int(name, value, 0, MAX_TOP_LOGPROBS)


def check_request_id(rid: Any) -> None:
    if rid is not None and not (isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID and rid.isprintable()):
        raise ParamError("request_id", f"1 to {MAX_REQUEST_ID} printable characters", rid)


def check_strategy(name: Any) -> str:
    if not isinstance(name, str) or name not in REGISTRY:
        raise ParamError("strategy", "one of " + ", ".join(sorted(REGISTRY)), name)
    return name


def check_resume(ids: Any, max_new: int, vocab_size: int, eos: int | None) -> tuple[int, ...]:
    """A continuation's emitted tokens (None or empty: a fresh request): fewer than ``max_new_tokens`` token ids,
    without the end-of-text token (a run that emitted it, or its whole budget, had ended)."""
    if not ids:
        return ()
    if not isinstance(ids, (list, tuple)) or len(ids) >= max_new:
        raise ParamError("resume_ids", f"fewer token ids than the {max_new} new tokens asked for (a run that "
                         "emitted them all had ended)", f"{len(ids)} ids" if isinstance(ids, (list, tuple)) else ids)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise ParamError("resume_ids", f"token ids in [0, {vocab_size - 1}]", i)
        if i == eos:
            raise ParamError("resume_ids", "token ids without the end-of-text token (that run had ended)", i)
    return tuple(ids)


def check_cache_salt(salt: Any) -> str | None:
    """None (no salt) or text of 1 to MAX_CACHE_SALT characters (vLLM refuses an empty salt too)."""
    return None if salt is None else check_text("cache_salt", salt, MAX_CACHE_SALT)


def check_stop(stop: Any) -> None:
    if not isinstance(stop, (list, tuple)):
        raise ParamError("stop", "a string or a list of strings", stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise ParamError("stop", f"at most {MAX_STOP_STRINGS} strings", f"{len(stop)} strings")
    for s in stop:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_LEN:
            raise ParamError("stop", f"strings of 1 to {MAX_STOP_LEN} characters", s)
        check_text("stop", s, MAX_STOP_LEN)                      # valid Unicode


def check_prompt_text(prompt: Any, target_len: int) -> str:
    """Prompt text short enough to tokenize: at most MAX_PROMPT_CHARS characters, and at most
    MAX_CHARS_PER_TOKEN per token of the target's length (longer text could not fit once tokenized)."""
    cap = min(MAX_PROMPT_CHARS, target_len * MAX_CHARS_PER_TOKEN)
    if isinstance(prompt, str) and len(prompt) > cap:
        raise ParamError("prompt", f"text of at most {cap} characters (model length {target_len} tokens)",
                         f"{len(prompt)} characters")
    return check_text("prompt", prompt, cap)


def check_prediction(pred: Any, tokenizer: Tokenizer, target_len: int, vocab_size: int) -> tuple[int, ...] | None:
    """A predicted output's token ids (None: none given): non-empty text or token ids, at most as long as a
    prompt may be."""
    if pred is None:
        return None
    if isinstance(pred, (list, tuple)):
        if not 0 < len(pred) <= min(MAX_PROMPT_IDS, target_len):
            raise ParamError("prediction", f"1 to {min(MAX_PROMPT_IDS, target_len)} token ids", f"{len(pred)} ids")
        for i in pred:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
                raise ParamError("prediction", f"token ids in [0, {vocab_size - 1}]", i)
        return tuple(pred)
    cap = min(MAX_PROMPT_CHARS, target_len * MAX_CHARS_PER_TOKEN)
    if isinstance(pred, str) and len(pred) > cap:
        raise ParamError("prediction", f"text of at most {cap} characters (model length {target_len} tokens)",
                         f"{len(pred)} characters")
    ids = tokenizer.encode(check_text("prediction", pred, cap))
    if not ids:
        raise ParamError("prediction", "text that encodes to at least one token", pred)
    return tuple(ids)


def check_options(strategy: str, options: Any) -> None:
    """Option names the strategy declares and values of bounded size (a string of at most MAX_OPTION_VALUE
    characters, a number, or a list of at most MAX_OPTION_CELLS numbers / rows of numbers), before any
    option parser sees them."""
    if not isinstance(options, dict):
        raise ParamError("options", "an object of strategy options", options)
    if len(options) > MAX_OPTIONS:
        raise ParamError("options", f"at most {MAX_OPTIONS} options", f"{len(options)} options")
    for key, value in options.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_OPTION_NAME:
            raise ParamError("option", f"names of 1 to {MAX_OPTION_NAME} characters", key)
        check_option_name(strategy, key)
        _check_option_value(key, value)


def _check_option_value(key: str, value: Any) -> None:
    if value is None or isinstance(value, (bool, int, float)):
        return
    if isinstance(value, str):
        check_text(key, value, MAX_OPTION_VALUE, allow_empty=True)
        return
    allowed = (f"a string of at most {MAX_OPTION_VALUE} characters, a number, or a list of at most "
               f"{MAX_OPTION_CELLS} numbers or rows of numbers")
    if not isinstance(value, (list, tuple)) or len(value) > MAX_OPTION_CELLS:
        raise ParamError(key, allowed, value)
    cells = 0
    for row in value:
        row = row if isinstance(row, (list, tuple)) else (row,)
        cells += len(row)
        if cells > MAX_OPTION_CELLS or not all(isinstance(c, (bool, int, float)) for c in row):
            raise ParamError(key, allowed, value)
