"""OpenAI response objects shared by ``/v1/completions`` and ``/v1/chat/completions``: usage, the two
``logprobs`` shapes, and the stream protocol (OpenAI API reference, "The completion object", "The chat
completion chunk object"; vLLM's ``continuous_usage_stats``).

A stream sends :meth:`ResponseFormat.opening` before the first engine chunk, :meth:`step` for each chunk and,
with ``stream_options.include_usage``, one last chunk with ``choices: []`` and ``usage`` (none without it);
with ``continuous_usage_stats`` every chunk carries the usage so far.  Log-probabilities are the target's raw
ones (log-softmax of its logits, before temperature / top-k / top-p), whatever strategy chose the token.
"""
from __future__ import annotations

import time

from cluster.engine.request import GenerationResult, PreparedRequest, StreamChunk, TokenLogprob
from cluster.serving.fronts.oai_fields import prediction_usage, speculative_decoding


def openai_finish(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def token_text(tokenizer, token_id: int) -> str:
    """One token's text as OpenAI shows it (a partial UTF-8 character decodes to U+FFFD)."""
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, entries: list[TokenLogprob | None], ids, offset: int = 0) -> dict:
    """The completions ``logprobs`` object of tokens ``ids`` (an entry None: the first prompt token, which
    has no log-probability); ``top_logprobs`` maps token text to logprob, the chosen token included (as
    vLLM does; tokens that decode to the same text, such as partial UTF-8 bytes, share one key: the most
    likely one's), ``text_offset`` is each token's start in the choice's text from ``offset``."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for tid, lp in zip(ids, entries):
        text = token_text(tokenizer, tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        logprobs.append(None if lp is None else lp.logprob)
        if lp is None:
            tops.append(None)
        else:
            top: dict[str, float] = {}
            for t, v in ((*lp.top, (tid, lp.logprob))):   # tokens of the same text: the most likely one's
                top.setdefault(token_text(tokenizer, t), v)
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    """The chat ``logprobs`` object: ``content`` with one entry per token, its top alternatives listed."""
    def one(tid: int, logprob: float) -> dict:
        text = token_text(tokenizer, tid)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**one(lp.token_id, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}
                        for lp in entries]}


class ResponseFormat:
    """The response objects of one request; subclasses give the endpoint's choice shapes."""

    object_whole = object_chunk = prefix = ""

    def __init__(self, model: str, req: PreparedRequest, tokenizer, *, include_usage: bool = False,
                 continuous_usage: bool = False):
        self.model, self.req, self.tokenizer = model, req, tokenizer
        self.id, self.created = self.prefix + req.rid, int(time.time())
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        self.generated = 0                    # tokens streamed so far
        self.stats = None                     # the finished request's statistics (a stream's last chunk)

    def usage(self, completion_tokens: int, stats=None) -> dict:
        """OpenAI's usage; with the finished request's ``stats``, ``prompt_tokens_details.cached_tokens`` (the
        prompt tokens the prefix cache held) and a predicted request's ``completion_tokens_details`` (accepted /
        rejected prediction tokens)."""
        prompt = len(self.req.prompt_ids)
        out = {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
               "total_tokens": prompt + completion_tokens}
        if stats is not None:
            out["prompt_tokens_details"] = {"cached_tokens": int(stats.cached_tokens)}
        if stats is not None and self.req.prediction_ids is not None:
            out["completion_tokens_details"] = prediction_usage(stats)
        return out

    def envelope(self, choices: list, *, chunk: bool, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": self.object_chunk if chunk else self.object_whole,
               "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def finished(self, out: dict, r: GenerationResult) -> dict:
        """The last object of a request: ours (``specserve``) and vLLM's ``metrics.speculative_decoding``."""
        out["specserve"] = self.extension(r)
        out["metrics"] = {"speculative_decoding": speculative_decoding(r.stats)}
        return out

    @staticmethod
    def extension(r: GenerationResult) -> dict:
        """Our ``specserve`` field: token ids, seed, finish reason and the decoding statistics."""
        return {"token_ids": r.token_ids, "seed": r.seed, "finish_reason": r.finish_reason,
                "stats": r.stats.to_dict()}

    # -- the stream ---------------------------------------------------------------------------------
    def opening(self) -> list[dict]:
        return []

    def step(self, chunk: StreamChunk) -> list[dict]:
        """The events of one engine chunk (none for a chunk without text that does not finish)."""
        self.generated += len(chunk.token_ids)
        if not (chunk.text or chunk.finish_reason or (chunk.logprobs and self.req.logprobs is not None)):
            return []
        if chunk.result is not None:
            self.stats = chunk.result.stats
        out = self.envelope([self.chunk_choice(chunk)], chunk=True,
                            usage=self.usage(self.generated, self.stats) if self.continuous_usage else None)
        return [out if chunk.result is None else self.finished(out, chunk.result)]

    def closing(self) -> list[dict]:
        return [self.envelope([], chunk=True, usage=self.usage(self.generated, self.stats))] \
            if self.include_usage else []

    def chunk_choice(self, chunk: StreamChunk) -> dict:
        raise NotImplementedError
