"""The served suite's cells (:mod:`cluster.bench.served`): ``c`` closed-loop gRPC clients, streaming
(``GenerateStream``) or unary (``Generate``), or the same requests one after another on the in-process engine;
per request its submit, first-token and end times (unary: first = end), its tokens or its gRPC status."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from cluster.bench.report import Timed
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError
from cluster.serving.client.sdk import SpecServeClient


@dataclass
class Rec(Timed):
    """One request: which prompt, when it was sent, its first and last chunk, its tokens or its error."""

    prompt: int = 0
    error: str | None = None          # gRPC status name
    chunks: int = 0                   # messages received (1 for a unary call)


@dataclass
class Cell:
    """One (row, concurrency) measurement; ``runtime`` is ``<topology>/<mode>`` (mode ``unary`` or
    ``streamed``) or :func:`in_process` of a topology."""

    row: str
    c: int
    runtime: str
    recs: list[Rec]
    seconds: float
    hops: dict | None = None          # the draft call's totals in the cell (CallTiming as a dict), separated only

    @property
    def streamed(self) -> bool:
        return self.runtime.endswith("/streamed")

    @property
    def ok(self) -> list[Rec]:
        return [r for r in self.recs if r.error is None]

    @property
    def tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.ok)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def failures(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.recs:
            if r.error is not None:
                out[r.error] = out.get(r.error, 0) + 1
        return out


def served_cell(client: SpecServeClient, prompts, n: int, c: int, max_new: int, strategy, opts,
                first_seed: int = 0, stream: bool = True,
                after: Callable[[int], None] | None = None, temperature: float = 0.0) -> tuple[list[Rec], float]:
    """Closed loop: ``c`` threads, each sending its next request (streaming, or unary with ``stream=False``)
    as soon as the last one ended, until ``n`` requests were sent (request j: prompt j mod len(prompts)).
    Returns the records in request order and the wall seconds from the first submit to the last end.

    ``after(j)`` (c = 1 only) runs once request j has ended and before the next is sent -- the same request
    in-process (:func:`in_process_request`), so that the two runtimes alternate request by request and this
    shared machine's drift affects both alike; the seconds returned are then the sum of the requests' own."""
    import grpc

    if after is not None and c != 1:
        raise ValueError(f"served_cell: after= pairs requests one by one, so c must be 1 (got c={c})")

    recs: list[Rec | None] = [None] * n
    nxt = iter(range(n))
    lock = threading.Lock()

    def one(j: int) -> None:
        rec = recs[j] = Rec(time.perf_counter(), prompt=j % len(prompts))
        streamed: list[int] = []
        try:
            if not stream:
                res = client.generate(prompt_ids=prompts[rec.prompt], max_new_tokens=max_new,
                                      temperature=temperature, seed=first_seed + j, strategy=strategy, options=opts, ignore_eos=True)
                rec.first = rec.last = time.perf_counter()
                rec.token_ids, rec.chunks = list(res.token_ids), 1
                return
            for chunk in client.stream(prompt_ids=prompts[rec.prompt], max_new_tokens=max_new,
                                       temperature=temperature, seed=first_seed + j, strategy=strategy, options=opts, ignore_eos=True):
                now = time.perf_counter()
                rec.chunks += 1
                if chunk.token_ids:
                    if rec.first is None:
                        rec.first = now
                    streamed += chunk.token_ids
                if chunk.HasField("result"):
                    rec.token_ids = list(chunk.result.token_ids)
                rec.last = now
            if rec.first is None or rec.last is None:
                rec.error = "NO_TOKENS"
            elif not rec.token_ids:
                rec.token_ids = streamed
        except grpc.RpcError as e:
            rec.error = e.code().name if e.code() is not None else "UNKNOWN"
        except Exception as e:            # noqa: BLE001 - counted as a failure of this request
            rec.error = type(e).__name__

    def client_loop() -> None:
        while True:
            with lock:
                j = next(nxt, None)
            if j is None:
                return
            one(j)
            if after is not None:
                after(j)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, daemon=True, name=f"bench-served-{i}")
               for i in range(min(c, n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if after is not None:
        return recs, request_seconds(recs)
    ends = [r.last for r in recs if r.last is not None]
    return recs, (max(ends) if ends else time.perf_counter()) - t0


def request_seconds(recs: list[Rec]) -> float:
    """The requests' own times, summed (submit to last chunk)."""
    return sum(r.last - r.submit for r in recs if r.last is not None)


def in_process(topology: str) -> str:
    """The runtime name of the in-process cells run beside ``topology``'s served ones."""
    return f"in-process:{topology}"


def in_process_cell(engine, prompts, n: int, max_new: int, strategy, opts) -> tuple[list[Rec], float]:
    """The same ``n`` requests one after another on the in-process engine (c = 1)."""
    recs = [in_process_request(engine, prompts, j, max_new, strategy, opts) for j in range(n)]
    return recs, request_seconds(recs)


def pair_with(engine, prompts, max_new: int, strategy, opts, into: list) -> Callable[[int], None]:
    """:func:`served_cell`'s ``after``: request j in-process, its record appended to ``into``."""
    return lambda j: into.append(in_process_request(engine, prompts, j, max_new, strategy, opts))


def in_process_request(engine, prompts, j: int, max_new: int, strategy, opts) -> Rec:
    """Request j of a cell (prompt j mod len(prompts), seed j) on the in-process engine."""
    rec = Rec(time.perf_counter(), prompt=j % len(prompts))
    try:
        res = engine.generate(greedy_request(prompts[rec.prompt], max_new, strategy, opts, j))
        rec.token_ids = list(res.token_ids)
    except ParamError as e:
        rec.error = type(e).__name__
    rec.last = time.perf_counter()
    rec.first = rec.first or rec.last
    return rec


def greedy_request(ids, max_new, strategy, opts, seed) -> GenerationRequest:
    """A greedy request of exactly ``max_new`` tokens (``ignore_eos``)."""
    return GenerationRequest(prompt_ids=list(ids), max_new_tokens=max_new, sampling=SamplingParams(0.0),
                             seed=seed, strategy=strategy, options=dict(opts), ignore_eos=True)
