"""What flows through the engine: a request as a client gives it, the prepared request that admission
makes of it once (validated and tokenized), stream chunks and the final result.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.core.logprobs import TokenLogprob  # noqa: F401 (re-exported: part of the request contract)
from cluster.core.sampling import SamplingParams
from cluster.core.stats import RequestStats
from cluster.strategies import Strategy

MAX_STOP_STRINGS, MAX_STOP_LEN = 8, 64


MAX_SEED = 2**63 - 1

MAX_TOP_LOGPROBS = 20              # top-n alternatives per token (OpenAI's top_logprobs limit)


# Request size limits, checked before any expensive work (tokenizing, copying, parsing option values).
MAX_MESSAGE_BYTES = 8 << 20        # a whole gRPC request message or HTTP body
MAX_PROMPT_CHARS = 1 << 20         # prompt text; also at most MAX_CHARS_PER_TOKEN x the target's length
MAX_CHARS_PER_TOKEN = 32
MAX_PROMPT_IDS = 1 << 20           # prompt token ids (the target's length is the tighter bound)
MAX_REQUEST_ID = 128               # printable characters
MAX_OPTIONS, MAX_OPTION_NAME, MAX_OPTION_VALUE = 16, 64, 256     # entries; characters of a name / a value
MAX_OPTION_CELLS = 256             # numbers in a structured (list) option value, at most 2 levels deep
MAX_JSON_DEPTH = 32                # HTTP body nesting
MAX_CACHE_SALT = 256               # characters of a cache_salt

# The smallest positive temperature: logits / T must stay finite (a subnormal T overflows to inf -> NaN).
MIN_TEMPERATURE = 1e-4


@dataclass
class GenerationRequest:
    """One generation. Give ``prompt`` text or ``prompt_ids``; ``options`` are the strategy's."""

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    strategy: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    request_id: str | None = None
    ignore_eos: bool = False
    logprobs: int | None = None          # None: none; n in [0, MAX_TOP_LOGPROBS]: each emitted token's logprob + top-n
    prompt_logprobs: int | None = None   # None: none; n: each prompt token's logprob + top-n (the first has none)
    prediction: str | list[int] | None = None   # predicted output, text or ids (OpenAI's prediction.content)
    grammar: Any = None                  # a cluster.core.constraint.Grammar: the output is constrained to it
    # vLLM's cache_salt: what the server keeps of this request (prefix cache blocks, the suffix drafter's index) is
    # shared only with requests of the same salt (None: no salt, shared with every request without one)
    cache_salt: str | None = None
    # a continuation: the tokens an earlier run of this same request (same seed) already emitted; it goes on
    # exactly as that run would have (docs/operator-guide.md, "Resumed streams"), counting them in its budget
    resume_ids: list[int] | None = None


@dataclass
class StreamChunk:
    """Tokens (and the text they complete) emitted by one step; the last chunk has a finish reason."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    result: "GenerationResult | None" = None   # set on the last chunk
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids (when the request asked)


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str                 # "length" | "eos" | "stop"
    stats: RequestStats
    seed: int
    request_id: str
    logprobs: list[TokenLogprob] | None = None                  # aligned with token_ids
    prompt_logprobs: list[TokenLogprob | None] | None = None    # aligned with the prompt ids; [0] is None

    def to_dict(self) -> dict:
        out = dict(token_ids=self.token_ids, text=self.text, finish_reason=self.finish_reason,
                   seed=self.seed, request_id=self.request_id, stats=self.stats.to_dict())
        if self.logprobs is not None:
            out["logprobs"] = [_logprob_dict(lp) for lp in self.logprobs]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [lp and _logprob_dict(lp) for lp in self.prompt_logprobs]
        return out


def _logprob_dict(lp: TokenLogprob) -> dict:
    return dict(token_id=lp.token_id, logprob=lp.logprob, top=[list(t) for t in lp.top])


@dataclass(frozen=True)
class PreparedRequest:
    """A request after admission: validated and tokenized once (:meth:`Engine.prepare`); everything
    downstream (coordinator, engine loop) works on this object, never on the raw request again."""

    rid: str
    prompt_ids: tuple[int, ...]        # [P] tokenized prompt
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    stop: tuple[str, ...]
    ignore_eos: bool
    strategy: Strategy                 # bound to the engine's models, options resolved
    logprobs: int | None = None        # top-n per emitted token (None: no logprobs)
    prompt_logprobs: int | None = None  # top-n per prompt token (None: no prompt logprobs)
    prediction_ids: tuple[int, ...] | None = None   # the tokenized predicted output (None: none)
    cache_salt: str | None = None      # GenerationRequest.cache_salt, checked
    resumed: tuple[int, ...] = ()      # [R] GenerationRequest.resume_ids, checked (R < max_new_tokens)

    @property
    def strategy_name(self) -> str:
        return self.strategy.name
