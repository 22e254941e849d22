"""``POST /v1/completions`` (OpenAI's legacy completions, as vLLM serves them): the request model, its
fields for the one request path, and the response objects.

``echo: true`` returns the prompt before the completion; with ``logprobs: n`` the prompt's tokens come first
in the ``logprobs`` object (the first prompt token's logprob is null, as OpenAI answers), which is what
lm-eval's ``local-completions`` loglikelihood requests read (``echo: true, logprobs: 1, max_tokens: 1``;
``max_tokens: 0`` scores the prompt alone).  Fields this server does not implement are accepted at their
neutral value only (:mod:`cluster.serving.fronts.neutral`).
"""
from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from cluster.engine.request import MAX_PROMPT_IDS, MAX_TOP_LOGPROBS, GenerationResult, StreamChunk
from cluster.errors import ParamError
from cluster.serving.fronts.neutral import NEUTRAL, OpenAIRequest, typed
from cluster.serving.fronts.oai_format import ResponseFormat, completion_logprobs, openai_finish
from cluster.serving.fronts.requests import Fields

ENDPOINT = "/v1/completions"
HTTP_NAMES = {"max_new_tokens": "max_tokens", "prompt_logprobs": "logprobs"}   # engine name -> OpenAI's


class CompletionRequest(OpenAIRequest):
    """OpenAI's completions parameters (the shared ones in :class:`OpenAIRequest`) plus vLLM's
    ``prompt_logprobs``."""

    prompt: str | list[int] = Field(description="a string or a list of token ids (one prompt per request)")
    max_tokens: int | None = Field(None, description="an integer >= 1, or 0 with echo and logprobs "
                                   "(default: the server's max_new_tokens)")
    echo: bool | None = Field(None, description="true or false (with stream: not with logprobs)")
    logprobs: int | None = Field(None, description=f"null or an integer in [0, {MAX_TOP_LOGPROBS}]")
    prompt_logprobs: int | None = Field(None, description=f"null or an integer in [0, {MAX_TOP_LOGPROBS}]")

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


def fields_from_openai(body: Any) -> tuple[Fields, CompletionRequest]:
    """The request's fields from a completions body, and the typed body (for the response's shape).
    :mod:`cluster.serving.fronts.requests` merges the config's defaults; the engine checks the ranges."""
    m = typed(CompletionRequest, body, ENDPOINT, NEUTRAL)
    if m.stream and m.echo and m.logprobs is not None:
        raise ParamError("echo", "false with stream and logprobs (prompt logprobs only in a whole response)",
                         m.echo)
    text, ids = (m.prompt, None) if isinstance(m.prompt, str) else (None, m.prompt)
    prompt_logprobs = m.prompt_logprobs
    if m.echo and prompt_logprobs is None and (m.logprobs is not None or m.max_tokens == 0):
        prompt_logprobs = m.logprobs or 0                                # echo + logprobs: the prompt's too
    return Fields(prompt=text, prompt_ids=ids, max_new_tokens=m.max_tokens, logprobs=m.logprobs,
                  prompt_logprobs=prompt_logprobs, names=HTTP_NAMES, **m.common_fields()), m


class CompletionFormat(ResponseFormat):
    """``text_completion`` objects, whole or streamed."""

    object_whole = object_chunk = "text_completion"
    prefix = "cmpl-"

    def __init__(self, model: str, req, tokenizer, m: CompletionRequest):
        usage, continuous = m.usage_flags
        super().__init__(model, req, tokenizer, include_usage=usage, continuous_usage=continuous)
        self.echo, self.offset = bool(m.echo), 0
        self.want_logprobs, self.want_prompt_logprobs = m.logprobs is not None, m.prompt_logprobs is not None
        self.prompt_text = (m.prompt if isinstance(m.prompt, str) else tokenizer.decode(list(req.prompt_ids))) \
            if self.echo else ""

    def whole(self, r: GenerationResult) -> dict:
        text, logprobs = r.text, None
        if self.want_logprobs:
            entries, ids = list(r.logprobs or []), list(r.token_ids)
            if self.echo and r.prompt_logprobs is not None:
                entries, ids = list(r.prompt_logprobs) + entries, list(self.req.prompt_ids) + ids
            logprobs = completion_logprobs(self.tokenizer, entries, ids)
        if self.echo:
            text = self.prompt_text + text
        choice = {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": openai_finish(r.finish_reason)}
        if self.want_prompt_logprobs and r.prompt_logprobs is not None:       # vLLM's extension, its shape
            choice["prompt_logprobs"] = [None if lp is None else {
                str(t): {"logprob": v, "decoded_token": self.tokenizer.decode([t])}
                for t, v in ((lp.token_id, lp.logprob), *lp.top)} for lp in r.prompt_logprobs]
        return self.finished(self.envelope([choice], chunk=False, usage=self.usage(len(r.token_ids), r.stats)), r)

    def opening(self) -> list[dict]:
        if not self.echo:
            return []
        self.offset = len(self.prompt_text)
        return [self.envelope([{"text": self.prompt_text, "index": 0, "logprobs": None, "finish_reason": None}],
                              chunk=True)]

    def chunk_choice(self, chunk: StreamChunk) -> dict:
        logprobs = None
        if chunk.logprobs is not None:
            logprobs = completion_logprobs(self.tokenizer, chunk.logprobs, chunk.token_ids, self.offset)
        self.offset += len(chunk.text)
        return {"text": chunk.text, "index": 0, "logprobs": logprobs,
                "finish_reason": openai_finish(chunk.finish_reason)}
