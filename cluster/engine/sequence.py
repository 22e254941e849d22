"""A live request inside the engine: its prepared request, step context, stop rules and output so far."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from cluster.core.logprobs import TokenLogprob, token_logprobs
from cluster.core.stats import RequestStats
from cluster.engine.request import GenerationResult, PreparedRequest, StreamChunk
from cluster.engine.stop import StopDecoder
from cluster.errors import ParamError
from cluster.strategies import StepContext

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)                   # identity: one object per live request
class Sequence:
    """One request from admission to release.  ``sink`` receives every :class:`StreamChunk` (the last
    one carries the result); ``finish`` ends as length | eos | stop | cancelled | deadline | error (then ``error``
    holds the exception)."""

    req: PreparedRequest
    ctx: StepContext
    decoder: StopDecoder
    eos: int | None
    sink: Callable[[StreamChunk], None] | None = None
    on_end: Callable[["Sequence"], None] | None = None    # called once it has left the engine, any outcome
    status: str = WAITING
    generated: list[int] = field(default_factory=list)
    finish: str | None = None
    error: BaseException | None = None
    result: GenerationResult | None = None   # set by the step that finishes it normally
    chunks: list[StreamChunk] = field(default_factory=list)    # when there is no sink
    t0: float = field(default_factory=time.perf_counter)
    deadline: float | None = None          # perf_counter time by which it must end (None: no deadline)
    stale: set[str] = field(default_factory=set)   # models holding no state for it yet or any more (Engine._prefill)
    logprobs: list[TokenLogprob] | None = None      # aligned with ``generated`` when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None   # aligned with the prompt; [0] is None
    resumes: int = 0                       # times it started again after the target lost its state

    def __post_init__(self):
        if self.req.logprobs is not None:
            self.logprobs = []
        if self.req.prompt_logprobs is not None and len(self.req.prompt_ids) == 1:
            self.prompt_logprobs = [None]          # nothing precedes the first token: nothing to score

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def reserved_tokens(self) -> int:
        """KV positions this request may need: prompt, every new token, and one step's draft."""
        return len(self.req.prompt_ids) + self.req.max_new_tokens + 1

    @property
    def stats(self) -> RequestStats:
        return self.ctx.stats

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.req.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def wants_resumed_logprobs(self) -> bool:
        """Logprobs are asked and the tokens a continuation resumes from have none yet."""
        return self.logprobs is not None and len(self.logprobs) < len(self.generated)

    @property
    def wants_scores(self) -> bool:
        """The target's prefill must score the committed tokens: for the prompt's logprobs, or for the logprobs of
        the tokens a continuation resumes from."""
        return self.wants_prompt_logprobs or self.wants_resumed_logprobs

    def set_scores(self, logits: torch.Tensor) -> None:
        """From the target's raw logits ``[N-1, V]`` over the committed tokens (row i: the position of token i+1):
        the prompt's logprobs when asked, and the resumed tokens' (what the first run streamed with them)."""
        ids, n = self.ctx.tokens, len(self.req.prompt_ids)
        if self.wants_prompt_logprobs:
            self.prompt_logprobs = [None] + token_logprobs(logits[:n - 1], ids[1:n], self.req.prompt_logprobs)
        if self.wants_resumed_logprobs:
            self.logprobs = token_logprobs(logits[n - 1:], ids[n:], self.req.logprobs)

    def resume_from(self, ids: tuple[int, ...]) -> None:
        """Continue a run that already emitted ``ids`` (their text was streamed): they are committed, counted in
        the token budget and the usage, fed to the stop rules (a stop string may span the cut) and the grammar
        (whose state is a function of the tokens), and scored at prefill when logprobs are asked."""
        self.ctx.tokens.extend(ids)
        self.generated = list(ids)
        self.ctx.stats.generated_tokens = len(ids)
        if self.decoder.push(list(ids))[1] is not None:
            raise ParamError("resume_ids", "tokens that do not complete a stop string (that run ended there)",
                             f"{len(ids)} tokens")

    def begin_step(self) -> None:
        self.ctx.budget = self.req.max_new_tokens - len(self.generated)
        self.ctx.step_logprobs = None

    def check_logprobs(self, new: list[int]) -> list[int] | BaseException:
        """``new`` if the step recorded the target's logprobs of each of its tokens (when asked), else an error
        that fails this request (a strategy that does not call ``StepContext.record_logprobs``)."""
        got = self.ctx.step_logprobs or []
        if self.logprobs is None or [lp.token_id for lp in got] == list(new):
            return new
        return RuntimeError(f"strategy {self.req.strategy_name} recorded logprobs for {len(got)} of its "
                            f"{len(new)} tokens")

    def accept(self, new: list[int]) -> StreamChunk:
        """Apply EOS, the token budget and stop strings to one step's tokens; returns the chunk to emit."""
        stats, req = self.ctx.stats, self.req
        streamed = len(self.generated)         # ids already handed out by earlier chunks
        if not stats.ttft_s:
            stats.ttft_s = time.perf_counter() - self.t0
        finish = None
        if self.eos is not None and self.eos in new:
            new, finish = new[:new.index(self.eos)], "eos"
        new = new[:req.max_new_tokens - len(self.generated)]
        self.ctx.tokens.extend(new)
        self.generated.extend(new)
        if self.logprobs is not None:     # the same cuts as the ids: EOS, the budget, a stop string
            self.logprobs.extend((self.ctx.step_logprobs or [])[:len(new)])
        text, stopped = self.decoder.push(new)
        if stopped is not None:            # keep the ids up to the stop string, even mid-block
            self.generated, finish = self.generated[:max(stopped, streamed)], "stop"
            if self.logprobs is not None:
                self.logprobs = self.logprobs[:len(self.generated)]
        elif finish is None and len(self.generated) >= req.max_new_tokens:
            finish = "length"
        if finish is not None:
            text += self.decoder.flush()
        stats.generated_tokens = len(self.generated)
        stats.wall_s = time.perf_counter() - self.t0
        self.finish = finish
        if finish is not None:
            self.result = GenerationResult(self.generated, self.decoder.text, finish, stats, req.seed, req.rid,
                                           self.logprobs, self.prompt_logprobs)
        # this step's ids that survive EOS, the budget and a stop string: the chunks concatenate to the result
        return StreamChunk(self.generated[streamed:], text, finish, self.result,
                           None if self.logprobs is None else self.logprobs[streamed:])

    def emit(self, chunk: StreamChunk) -> None:
        (self.sink or self.chunks.append)(chunk)
