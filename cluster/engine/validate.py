"""Admission: a request is validated and tokenized once, into a :class:`PreparedRequest`."""
from __future__ import annotations

import os
import uuid
from typing import Any

from cluster.core.interfaces import ModelHandle, Tokenizer
from cluster.engine.request import (
    MAX_SEED,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    GenerationRequest,
    PreparedRequest,
)
from cluster.errors import ParamError, check_int
from cluster.strategies import REGISTRY, resolve_options


def prepare(req: GenerationRequest, models: dict[str, ModelHandle], tokenizer: Tokenizer, target: str, *,
            default_strategy: str, defaults: dict[str, Any], max_new_tokens_limit: int,
            vocab_size: int) -> PreparedRequest:
    """Validate ``req`` against the served models (raises :class:`ParamError` naming the field, the
    allowed range and the value) and tokenize its prompt; returns the one object that flows down."""
    if req.prompt_ids is not None and len(req.prompt_ids) > 0:
        ids = list(req.prompt_ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
                raise ParamError("prompt_ids", f"token ids in [0, {vocab_size - 1}]", i)
    elif req.prompt:
        ids = tokenizer.encode(req.prompt)
    else:
        raise ParamError("prompt", "non-empty text or token ids", req.prompt or "")
    if not ids:
        raise ParamError("prompt", "text that encodes to at least one token", req.prompt)
    max_new = check_int("max_new_tokens", req.max_new_tokens, 1, max_new_tokens_limit)
    name = req.strategy or default_strategy
    if name not in REGISTRY:
        raise ParamError("strategy", "one of " + ", ".join(sorted(REGISTRY)), name)
    opts = resolve_options(name, req.options, defaults)
    strategy = REGISTRY[name](opts, models, target)
    max_len = min(models[r].max_length for r in strategy.roles())
    if len(ids) + max_new > max_len:
        raise ParamError("prompt", f"at most {max_len - max_new} tokens with max_new_tokens={max_new} "
                         f"(model length {max_len})", f"{len(ids)} tokens")
    if len(req.stop) > MAX_STOP_STRINGS:
        raise ParamError("stop", f"at most {MAX_STOP_STRINGS} strings", len(req.stop))
    for s in req.stop:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_LEN:
            raise ParamError("stop", f"strings of 1 to {MAX_STOP_LEN} characters", s)
    seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "little") & MAX_SEED
    seed = check_int("seed", seed, 0, MAX_SEED)
    return PreparedRequest(req.request_id or uuid.uuid4().hex, tuple(ids), max_new, req.sampling, seed,
                           tuple(req.stop), req.ignore_eos, strategy)
