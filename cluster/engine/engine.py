"""The speculative decoding engine: validates a request, runs a strategy's steps, applies stop rules.

It holds model handles (in-process workers or remote actor handles, :class:`cluster.core.interfaces.ModelHandle`) and is
otherwise stateless between requests, so one engine serves many concurrent requests.
"""
from __future__ import annotations

import os
import time
import uuid
from typing import Any, Iterator

from cluster.core.interfaces import ModelHandle, Tokenizer
from cluster.core.sampling import Rng
from cluster.core.stats import RequestStats
from cluster.engine.request import (
    MAX_SEED,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    GenerationRequest,
    GenerationResult,
    PreparedRequest,
    StreamChunk,
)
from cluster.engine.stop import StopDecoder
from cluster.errors import ParamError, check_int
from cluster.strategies import REGISTRY, StepContext, resolve_options


class Engine:
    """Runs any registered strategy over a set of model handles.

    ``models`` maps names to handles and must contain ``target``; ``defaults`` holds default strategy
    options (from the config), ``max_new_tokens_limit`` the server-side cap.
    """

    def __init__(self, models: dict[str, ModelHandle], tokenizer: Tokenizer, *, target: str = "target",
                 default_strategy: str = "speculative", defaults: dict[str, Any] | None = None,
                 max_new_tokens_limit: int = 1024, rng_factory=Rng):
        if target not in models:
            raise ValueError(f"models must include the target {target!r}")
        self.models, self.tokenizer, self.target = dict(models), tokenizer, target
        self.default_strategy = default_strategy
        self.defaults = dict(defaults or {})
        self.max_new_tokens_limit = max_new_tokens_limit
        self.rng_factory = rng_factory      # seed -> Rng; the exact-enumeration tests swap it
        self.vocab_size = min(m.vocab_size for m in self.models.values())

    # -- validation ---------------------------------------------------------------------------
    def prepare(self, req: GenerationRequest | PreparedRequest) -> PreparedRequest:
        """Validate and tokenize ``req`` once (raises ParamError); a prepared request passes through."""
        if isinstance(req, PreparedRequest):
            return req
        if req.prompt_ids is not None and len(req.prompt_ids) > 0:
            ids = list(req.prompt_ids)
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                    raise ParamError("prompt_ids", f"token ids in [0, {self.vocab_size - 1}]", i)
        elif req.prompt:
            ids = self.tokenizer.encode(req.prompt)
        else:
            raise ParamError("prompt", "non-empty text or token ids", req.prompt or "")
        if not ids:
            raise ParamError("prompt", "text that encodes to at least one token", req.prompt)
        max_new = check_int("max_new_tokens", req.max_new_tokens, 1, self.max_new_tokens_limit)
        name = req.strategy or self.default_strategy
        if name not in REGISTRY:
            raise ParamError("strategy", "one of " + ", ".join(sorted(REGISTRY)), name)
        opts = resolve_options(name, req.options, self.defaults)
        strategy = REGISTRY[name](opts, self.models, self.target)
        max_len = min(self.models[r].max_length for r in strategy.roles())
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

    # -- generation ---------------------------------------------------------------------------
    def generate(self, req: GenerationRequest | PreparedRequest) -> GenerationResult:
        for chunk in self.stream(req):
            pass
        return chunk.result

    def stream(self, req: GenerationRequest | PreparedRequest) -> Iterator[StreamChunk]:
        """Yield one :class:`StreamChunk` per step; the last one carries the :class:`GenerationResult`.

        Every model's per-request state is released when the generator ends, fails or is closed.
        """
        req = self.prepare(req)
        ids, strategy, seed, rid = list(req.prompt_ids), req.strategy, req.seed, req.rid
        stats = RequestStats(strategy=strategy.name, prompt_tokens=len(ids))
        ctx = StepContext(rid, self.models, self.target, req.sampling, self.rng_factory(seed), stats,
                          list(ids), 0)
        decoder = StopDecoder(self.tokenizer, req.stop)
        eos = None if req.ignore_eos else self.tokenizer.eos_token_id
        handles = [self.models[r] for r in strategy.roles()]
        t0 = time.perf_counter()
        try:
            for h in handles:
                h.prefill(rid, ids, req.sampling, seed)
            generated: list[int] = []
            finish = None
            while finish is None:
                ctx.budget = req.max_new_tokens - len(generated)
                new = strategy.step(ctx)
                if not stats.ttft_s:
                    stats.ttft_s = time.perf_counter() - t0
                if eos is not None and eos in new:
                    new, finish = new[:new.index(eos)], "eos"
                new = new[:req.max_new_tokens - len(generated)]
                ctx.tokens.extend(new)
                generated.extend(new)
                text, stopped = decoder.push(generated)
                if stopped is not None:
                    generated, finish = generated[:stopped], "stop"
                elif finish is None and len(generated) >= req.max_new_tokens:
                    finish = "length"
                if finish is not None:
                    text += decoder.flush()
                stats.generated_tokens = len(generated)
                stats.wall_s = time.perf_counter() - t0
                result = None if finish is None else \
                    GenerationResult(generated, decoder.text, finish, stats, seed, rid)
                yield StreamChunk(new if stopped is None else [], text, finish, result)
        finally:
            for h in handles:
                h.release(rid)
