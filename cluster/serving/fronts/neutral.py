"""OpenAI / vLLM request fields served only at their neutral value, and the typing of a JSON body.

Standard clients send fields this server does not implement at the value that turns them off
(``vllm bench serve`` sends ``repetition_penalty: 1.0`` and ``logprobs: null``; guidellm ``stop: null``; the
OpenAI SDK leaves them out).  Each such field is accepted at its neutral value and refused, naming it, at any
other: never silently ignored.  The list follows vLLM's OpenAI protocol (``CompletionRequest`` and
``ChatCompletionRequest`` in vllm/entrypoints/openai/protocol.py: their sampling and extra parameters) and
OpenAI's API reference.  What a request model declares itself (``logprobs``, ``echo``, ``top_k``, ...) is
implemented, not listed here.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from cluster.engine.request import MAX_CACHE_SALT
from cluster.errors import ParamError, shown
from cluster.serving.fronts.oai_fields import PREDICTION_ALLOWED, prediction_text
from cluster.strategies import REGISTRY

ANY_BOOL = (True, False)
# field -> the values that leave the output unchanged (None: the field sent as null); both endpoints
NEUTRAL: dict[str, tuple] = {
    "n": (None, 1), "best_of": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "logit_bias": (None, {}), "min_p": (None, 0), "min_tokens": (None, 0), "stop_token_ids": (None, []),
    "bad_words": (None, []), "allowed_token_ids": (None,), "truncate_prompt_tokens": (None,),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "detokenize": (None, True),
    "return_tokens_as_token_ids": (None, False), "priority": (None, 0), "suffix": (None, ""),
    "response_format": (None, {"type": "text"}), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structural_tag": (None,), "logits_processors": (None,),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, *ANY_BOOL),
    "metadata": (None, {}), "store": (None, False), "service_tier": (None, "auto", "default"),
    "chat_template_kwargs": (None, {}), "mm_processor_kwargs": (None, {}),
    "kv_transfer_params": (None,), "vllm_xargs": (None, {}),
}
CHAT_ONLY_NEUTRAL = {"echo": (None, False), "add_generation_prompt": (None, True),
                     "continue_final_message": (None, False), "add_special_tokens": (None, False),
                     "documents": (None, []), "chat_template": (None,), "modalities": (None, ["text"]),
                     "prompt_logprobs": (None,)}


class OpenAIRequest(BaseModel):
    """The fields both endpoints share: OpenAI's sampling fields, vLLM's ``top_k`` and ``ignore_eos``, and our
    ``strategy`` and ``options``.  Strict types, unknown fields forbidden; each field's description is the
    allowed range a refusal names."""
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="the served model id (GET /v1/models)")
    temperature: float | None = Field(None, description="a number >= 0 (0 = greedy)")
    top_p: float | None = Field(None, description="a number in (0.0, 1.0]")
    top_k: int | None = Field(None, description="an integer >= 0, or -1 (0 and -1 = off)")
    seed: int | None = Field(None, description="an integer")
    stop: str | list[str] | None = Field(None, description="a string or a list of strings")
    stream: bool = Field(False, description="true or false")
    stream_options: Any = Field(None, description="an object {include_usage, continuous_usage_stats}")
    user: str | None = Field(None, description="a string (an end-user id; accepted, not used)")
    strategy: str | None = Field(None, description="one of " + ", ".join(sorted(REGISTRY)))
    options: dict[str, Any] | None = Field(None, description="an object of strategy options")
    ignore_eos: bool | None = Field(None, description="true or false")
    prediction: Any = Field(None, description=PREDICTION_ALLOWED)
    cache_salt: str | None = Field(None, description=f"null or text of 1 to {MAX_CACHE_SALT} characters (vLLM's: "
                                   "what is cached for the request is shared only with requests of the same salt)")
    resume_token_ids: list[int] | None = Field(None, description="null or fewer token ids than max_tokens: what an "
                                               "earlier run of this same request (same seed) emitted; it goes on "
                                               "from there exactly")
    _usage: tuple[bool, bool] = PrivateAttr((False, False))

    @model_validator(mode="after")
    def _parse_stream_options(self):
        self._usage = stream_options(self.stream_options, self.stream)    # once, before any work
        return self

    @property
    def usage_flags(self) -> tuple[bool, bool]:
        """(include_usage, continuous_usage_stats), parsed from ``stream_options`` with the body."""
        return self._usage

    def common_fields(self) -> dict:
        """The shared fields as :class:`cluster.serving.fronts.requests.Fields` keywords (``top_k: -1`` is off)."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=0 if self.top_k == -1 else self.top_k,
                    seed=self.seed, stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
                    strategy=self.strategy, options=self.options or {}, ignore_eos=bool(self.ignore_eos),
                    model=self.model, prediction=prediction_text(self.prediction), cache_salt=self.cache_salt,
                    resume_ids=self.resume_token_ids)


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality with types kept apart (``true`` is not ``1``; ``1`` and ``1.0`` are the same number)."""
    if isinstance(neutral, bool) or neutral is None or isinstance(neutral, (str, list, dict)):
        return type(value) is type(neutral) and value == neutral
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == neutral


def drop_neutral(body: dict, table: dict[str, tuple]) -> dict:
    """``body`` without the fields of ``table`` it sends at a neutral value; any other value is refused."""
    out = {}
    for key, value in body.items():
        neutral = table.get(key)
        if neutral is None:
            out[key] = value
        elif not any(_same(value, n) for n in neutral):
            shown_values = ", ".join("null" if n is None else shown(n) for n in neutral)
            raise ParamError(key, f"{shown_values} (not supported: only the value that turns it off)", value)
    return out


def typed(cls: type[BaseModel], body: Any, endpoint: str, table: dict[str, tuple]):
    """``cls`` (a pydantic model, strict, extra fields forbidden) from a parsed JSON body; the first problem
    as a ParamError naming its parameter (an unknown one by its name, shown escaped and cut when it is not a
    plain identifier), its allowed range (the field's description) and the value."""
    if not isinstance(body, dict):
        raise ParamError("body", "a JSON object", body)
    body = drop_neutral(body, table)
    for key in body:
        if key not in cls.model_fields:
            name = key if key.isidentifier() and len(key) <= 64 else shown(key, 64)
            raise ParamError(name, f"unset: not a parameter of {endpoint} (its parameters: "
                             + ", ".join(cls.model_fields) + "; and at their neutral value only: n, best_of, "
                             "presence_penalty, repetition_penalty, ... (docs/operator-guide.md))", body[key])
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


def stream_options(value: Any, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) from ``stream_options`` (OpenAI; the second is vLLM's: usage
    in every chunk).  Only with ``stream: true``, as vLLM requires."""
    allowed = "null or an object {include_usage: bool, continuous_usage_stats: bool} (with stream: true)"
    if value is None:
        return False, False
    if not isinstance(value, dict) or not stream or \
            any(k not in ("include_usage", "continuous_usage_stats") or type(v) is not bool for k, v in value.items()):
        raise ParamError("stream_options", allowed, value)
    return value.get("include_usage", False), value.get("continuous_usage_stats", False)
