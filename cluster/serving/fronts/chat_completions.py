"""``POST /v1/chat/completions`` (OpenAI's chat completions, as vLLM serves them): the request model, its
fields for the one request path and the response objects.

The messages are rendered with the served checkpoint's own chat template (:mod:`cluster.models.chat_template`;
a model without one is refused naming ``messages``).  Streaming sends ``chat.completion.chunk`` objects, the
first delta carrying ``role: assistant``, then ``data: [DONE]``; ``stream_options.include_usage`` adds one
final chunk with ``choices: []`` and ``usage``.  ``logprobs: true`` with ``top_logprobs: n`` returns the
target's log-probability of each token and its n most likely alternatives (``logprobs.content``).
"""
from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr

from cluster.engine.request import MAX_TOP_LOGPROBS, GenerationResult, StreamChunk
from cluster.errors import ParamError
from cluster.serving.fronts.neutral import CHAT_ONLY_NEUTRAL, NEUTRAL, OpenAIRequest, typed
from cluster.serving.fronts.oai_fields import TEMPLATE_KWARGS_ALLOWED, template_kwargs
from cluster.serving.fronts.oai_format import ResponseFormat, chat_logprobs, openai_finish
from cluster.models.tool_calls import ToolStream
from cluster.serving.fronts.requests import Fields
from cluster.serving.fronts.structured import structured, tool_call_objects

ENDPOINT = "/v1/chat/completions"
STRUCTURED = ("tools", "tool_choice", "parallel_tool_calls", "response_format")    # implemented on chat
# chat_template_kwargs is served on chat (neutral-only on completions, where no template is rendered)
CHAT_NEUTRAL = {k: v for k, v in {**NEUTRAL, **CHAT_ONLY_NEUTRAL}.items()
                if k not in STRUCTURED and k != "chat_template_kwargs"}


class ChatRequest(OpenAIRequest):
    """OpenAI's chat parameters (the shared ones in :class:`OpenAIRequest`)."""

    messages: Any = Field(description="a non-empty list of {role, content} objects")
    max_tokens: int | None = Field(None, description="an integer >= 1 (default: the server's max_new_tokens)")
    max_completion_tokens: int | None = Field(None, description="an integer >= 1 (wins over max_tokens)")
    logprobs: bool | None = Field(None, description="true or false")
    top_logprobs: int | None = Field(None, description=f"null or an integer in [0, {MAX_TOP_LOGPROBS}] "
                                     "(with logprobs: true)")
    chat_template_kwargs: Any = Field(None, description=TEMPLATE_KWARGS_ALLOWED)
    tools: Any = Field(None, description="a list of function tools")
    tool_choice: Any = Field(None, description="none, auto, required or a named function")
    parallel_tool_calls: Any = Field(None, description="true or false")
    response_format: Any = Field(None, description="an object {type: text | json_object | json_schema}")
    _structured: Any = PrivateAttr(None)


def fields_from_chat(body: Any) -> tuple[Fields, ChatRequest]:
    """The request's fields from a chat body, and the typed body (for the response's shape)."""
    m = typed(ChatRequest, body, ENDPOINT, CHAT_NEUTRAL)
    if not m.logprobs and m.top_logprobs not in (None, 0):
        raise ParamError("top_logprobs", "null or 0 unless logprobs is true", m.top_logprobs)
    limit = "max_completion_tokens" if m.max_completion_tokens is not None else "max_tokens"
    m._structured = structured(m.tools, m.tool_choice, m.parallel_tool_calls, m.response_format)
    return Fields(messages=m.messages, max_new_tokens=getattr(m, limit),
                  template_kwargs=template_kwargs(m.chat_template_kwargs),
                  logprobs=(m.top_logprobs or 0) if m.logprobs else None, structured=m._structured,
                  names={"max_new_tokens": limit, "logprobs": "top_logprobs"}, **m.common_fields()), m


class ChatFormat(ResponseFormat):
    """``chat.completion`` / ``chat.completion.chunk`` objects."""

    object_whole, object_chunk, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def __init__(self, model: str, req, tokenizer, m: ChatRequest):
        usage, continuous = m.usage_flags
        super().__init__(model, req, tokenizer, include_usage=usage, continuous_usage=continuous)
        s = m._structured
        self.tools = ToolStream(s.fmt) if s is not None and s.reads_calls else None     # None: content only
        # finish_reason "tool_calls" as vLLM sets it: calls read in auto mode or forced by required; a named
        # function's call finishes with "stop" (as OpenAI's and vLLM's forced named calls do)
        self.call_finish = "stop" if s is not None and s.choice == "function" else "tool_calls"

    def _logprobs(self, entries) -> dict | None:
        return None if entries is None or self.req.logprobs is None else chat_logprobs(self.tokenizer, entries)

    def whole(self, r: GenerationResult) -> dict:
        message, finish = {"role": "assistant", "content": r.text}, openai_finish(r.finish_reason)
        content, calls = self.tools.fmt.parse(r.text) if self.tools is not None else (r.text, [])
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": tool_call_objects(calls)}
            finish = self.call_finish if finish != "length" else finish
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(r.logprobs), "finish_reason": finish}
        return self.finished(self.envelope([choice], chunk=False, usage=self.usage(len(r.token_ids), r.stats)), r)

    def opening(self) -> list[dict]:
        return [self.envelope([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}], chunk=True)]

    def chunk_choice(self, chunk: StreamChunk) -> dict:
        text, finish, delta = chunk.text, openai_finish(chunk.finish_reason), {}
        if self.tools is not None:
            text = self.tools.feed(text)
            if finish is not None:
                rest, calls = self.tools.finish()
                text += rest
                if calls:
                    delta["tool_calls"] = tool_call_objects(calls, streamed=True)
                    finish = self.call_finish if finish != "length" else finish
        if text:
            delta = {"content": text, **delta}
        return {"index": 0, "delta": delta, "logprobs": self._logprobs(chunk.logprobs), "finish_reason": finish}
