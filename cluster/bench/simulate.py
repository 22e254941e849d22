"""A discrete-event simulation of one serving unit's served step (issue 32 item 5): what the served table
should read, given what each piece costs.

The unit: ``clients`` closed-loop clients, each sending requests of ``new_tokens`` output tokens (greedy,
``ignore_eos``) back to back, through a front (Serve's proxy and the deployment: one FIFO server that spends
``front_request / 2`` on a request coming in and as much, plus ``front_chunk`` per chunk, on its answer going
out); the coordinator's step loop with continuous batching (requests join between steps up to ``max_batch``,
their prompts prefilled in one batched forward, then one batched target forward per step priced by
``target(rows, tokens)``, a :class:`cluster.core.forward_cost.ForwardCost`), each step paying the served loop's
own work, ``served_step`` per step and ``served_token`` per token it emitted (handing the rows' tokens to the
front, waking their waiters: paid per step and token, not per request, so a strategy that needs fewer steps pays
the first part fewer times); and the draft side.

A step of speculative decoding with draft length k over B rows costs (Leviathan et al., *Fast Inference from
Transformers via Speculative Decoding*, section 3.4, with each call read from measured tables)

* **colocated** (drafting and verification back to back in one process): ``k drafter(B, 1) + target(B, k + 1)``
  plus the engine's own work per step, ``overhead(B)``;
* **separated** (the draft side in its own process): one draft call whose reply reaches the coordinator
  ``rtt`` after it was sent plus the draft side's compute (``side_work`` and k drafter forwards for the rows
  it drafts), then the verification.  The draft side has a core of its own, or shares the front's
  (``Unit.shared_core``: one FIFO timeline for both, as on a 2-core machine).  With ``predraft`` the draft side
  drafts the next block for every row during the verification (PEARL's post-verify, Liu et al., *PEARL*, sec. 3),
  starting when its reply has left; the next call waits for that pre-draft to finish, and only the rows whose
  bet came true -- the whole block accepted and the bonus token guessed -- skip drafting.

Tokens per row per step: ``accepted + 1``, the accepted count drawn per row and step, replayed from a measured
histogram (``accepted[n]``: share of steps that accepted n of k) or i.i.d. per position with rate ``alpha``, the
bonus guessed with probability ``alpha``.  A free drafter (``drafter=None``, Max-Gram) costs only ``overhead``.
The speculator topology: :meth:`_Sim.speculate`.  Seeded: the same inputs and seed give the same result.
"""
from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from cluster.core.draft.side import DraftSide

Price = Callable[[float, float], float]          # (rows, tokens per row) -> seconds: a ForwardCost


@dataclass(frozen=True)
class Unit:
    """What one serving unit's pieces cost, in seconds."""

    target: Price
    prefill: Callable[[int], float] = lambda rows: 0.0      # rows joining -> their prompts' batched forward
    front_request: float = 0.0
    front_chunk: float = 0.0
    shared_core: bool = False                    # the draft side's process shares the front's core (FIFO)
    max_batch: int = 32
    served_step: float = 0.0                     # the served loop's own work per step ...
    served_token: float = 0.0                    # ... and per token the step emitted


@dataclass(frozen=True)
class Strategy:
    """One row of the served table: how its steps draft and what they accept."""

    name: str
    k: int = 0                                   # 0: autoregressive
    drafter: Price | None = None                 # a neural drafter's forward; None: free (Max-Gram)
    draft_prefill: Callable[[int], float] | None = None   # the drafter's prompt prefill (where it is in-process)
    alpha: float = 0.0                           # i.i.d. acceptance per position; the bonus-guess rate
    accepted: tuple[float, ...] | None = None    # measured shares of steps accepting 0..k (replayed instead)
    separated: bool = False                      # the draft side in its own process, one call per step
    rtt: float = 0.0                             # that call beyond the draft side's compute
    side_work: float = 0.0                       # the draft side's own work per block it drafts (its program)
    predraft: bool = False                       # separated only: draft the next block during verification
    predraft_rows: int = DraftSide.MAX_ROWS      # ... for calls of at most this many rows (as the draft side)
    overhead: Callable[[int], float] = lambda rows: 0.0   # the engine's own work per step, by rows
    speculator: bool = False                     # near drafting for misses, a far speculator's fills (side core)
    hit_rate: float | None = None                # speculator: share of row-steps the cache serves, answers in time,
    branches: int = 1                            # ... drafting this many branches per row in each fill
    plain_from: int | None = None                # from this many rows up a step decodes plainly (plain_from_batch),
    plain_overhead: Callable[[int], float] | None = None   # ... with the engine's work of a plain step
    chunks_per_step: int = 0                     # chunks sent per step per row (0: unary, one per request)


@dataclass
class Result:
    """One simulated cell."""

    tokens: int = 0
    seconds: float = 0.0
    requests: int = 0
    steps: int = 0
    row_steps: int = 0
    hits: int = 0                                # row-steps served by a pre-drafted block
    step_seconds: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def step_ms(self) -> float:
        return 1e3 * sum(self.step_seconds) / len(self.step_seconds) if self.step_seconds else 0.0

    @property
    def tokens_per_row_step(self) -> float:
        return self.tokens / self.row_steps if self.row_steps else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.row_steps if self.row_steps else 0.0


@dataclass
class _Req:
    rid: int
    client: int
    left: int
    accept: random.Random                        # this request's own draws: the same whatever the timing
    guess: random.Random
    chunks: int = 0


class _Sim:
    def __init__(self, unit: Unit, s: Strategy, clients: int, requests: int, new_tokens: int, seed: int):
        self.u, self.s, self.orig, self.n = unit, s, s, new_tokens    # s: this step's view (plain or not)
        self.plain = replace(s, k=0, drafter=None, speculator=False, separated=False,
                             overhead=s.plain_overhead or s.overhead)
        self.seed, self.heap, self.seq, self.to_issue, self.front_free = seed, [], 0, requests, 0.0
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.busy, self.side_ready = False, 0.0  # side_ready: when the draft side's pre-draft is done
        self.predrafted = False                  # the draft side pre-drafts during this step's verification
        self.bets: set[int] = set()              # the rows whose pre-drafted block is usable
        self.answer_at = 0.0                     # speculator: when the last fill's answer reached the coordinator
        self.res = Result()
        for c in range(min(clients, requests)):
            self.submit(0.0, c)

    def push(self, t: float, kind: str, data) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, data))

    def front(self, t: float, work: float) -> float:
        self.front_free = max(t, self.front_free) + work
        return self.front_free

    @property
    def side_free(self) -> float:
        """When the draft side's core is free: after its pre-draft, and after the front's work where they share it."""
        return self.front_free if self.u.shared_core else self.side_ready

    @side_free.setter
    def side_free(self, t: float) -> None:
        if self.u.shared_core:
            self.front_free = t
        else:
            self.side_ready = t

    def submit(self, t: float, client: int) -> None:
        if self.to_issue > 0:
            self.to_issue -= 1
            rid = self.to_issue
            draws = (random.Random(f"{self.seed}/{rid}/{kind}") for kind in ("accept", "guess"))
            req = _Req(rid, client, self.n, *draws)
            self.push(self.front(t, self.u.front_request / 2), "arrive", req)

    def run(self) -> Result:
        while self.heap:
            t, _, kind, data = heapq.heappop(self.heap)
            if kind == "arrive":
                self.waiting.append(data)
                if not self.busy:                # wake the loop after every arrival at this instant
                    self.busy = True
                    self.push(t, "wake", None)
            elif kind == "wake":
                self.start_step(t)
            elif kind == "step":
                self.end_step(t, data)
            else:                                # "done": the answer reached its client
                self.res.requests += 1
                self.res.seconds = t
                self.submit(t, data.client)
        return self.res

    def accepted(self, rng: random.Random) -> int:
        s = self.s
        if s.accepted is not None:
            return rng.choices(range(len(s.accepted)), weights=s.accepted)[0]
        n = 0
        while n < s.k and rng.random() < s.alpha:
            n += 1
        return n

    def predrafting(self, rows: int) -> bool:
        s = self.s
        return s.predraft and s.separated and s.drafter is not None and rows <= s.predraft_rows

    def start_step(self, t: float) -> None:
        u = self.u
        room = u.max_batch - len(self.running)
        joined = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        t0, rows, orig = t, len(self.running) + len(joined), self.orig
        s = self.s = self.plain if orig.plain_from and rows >= orig.plain_from else orig
        if joined:
            t += u.prefill(len(joined))
            if s.draft_prefill is not None and not s.separated and s.k:
                t += s.draft_prefill(len(joined))
            self.running += joined
        per_token = s.drafter(rows, 1) if s.drafter is not None and s.k else 0.0
        if s.k and s.separated:                  # one draft call: half the round trip each way
            ready = max(t + s.rtt / 2, self.side_free)
            misses = sum(r.rid not in self.bets for r in self.running)
            draft = s.side_work + (s.k * s.drafter(misses, 1) if s.drafter is not None else 0.0) if misses else 0.0
            self.res.hits += rows - misses
            leaves = ready + draft
            self.side_free = leaves
            t = leaves + s.rtt / 2
            self.predrafted = self.predrafting(rows)
            if self.predrafted:
                self.side_free = leaves + s.side_work + s.k * per_token
        elif s.k and s.speculator and s.drafter is not None:
            t = self.speculate(t, rows)
        else:
            t += s.k * per_token
        t += u.target(rows, s.k + 1) + s.overhead(rows) + u.served_step
        self.busy = True
        self.push(t, "step", t - t0)

    def speculate(self, t: float, rows: int) -> float:
        """The speculator topology (:mod:`cluster.core.draft.near_far`), for steps of at most ``predraft_rows`` rows
        (beyond, no fills): the rows whose bet came true (with probability ``hit_rate``, else the whole block
        accepted and the bonus guessed) take their cached block if the last fill's answer is in, or when it lands
        while near drafts (raced, :mod:`cluster.core.draft.race`: near stops at its next round); the rest draft
        near.  Then this step's fill goes out (k + 1 drafter rounds over ``branches`` per row, on the shared core),
        answered from the look-ahead (``Speculator.ahead``) when every row came as predicted, else drafted once
        the core is free (after a miss the speculator drafts the same block beside near, ``NearFarSide._outcome``:
        no sooner here, where nothing prices its catching up).  Returns when verification starts."""
        s = self.s
        bets, near = sum(r.rid in self.bets for r in self.running), s.drafter(rows, 1)
        if self.answer_at <= t:
            hit, t = bets, t + (s.k * s.drafter(rows - bets, 1) if rows > bets else 0.0)
        elif bets == rows and self.answer_at < t + s.k * near:     # raced: taken once it lands, near stops
            hit, t = rows, t + near * math.ceil((self.answer_at - t) / near)
        else:
            hit, t = 0, t + s.k * near
        self.res.hits += hit
        self.predrafted = rows <= s.predraft_rows
        if self.predrafted:
            fill = s.side_work + (s.k + 1) * s.drafter(rows * s.branches, 1)
            start = self.answer_at if hit == rows else max(t + s.rtt / 2, self.side_free)
            self.side_free = start + fill
            self.answer_at = max(start + fill, t) + s.rtt / 2
        return t

    def end_step(self, t: float, seconds: float) -> None:
        s, res = self.s, self.res
        res.steps += 1
        res.step_seconds.append(seconds)
        res.row_steps += len(self.running)
        bets, got = set(), {}
        for r in self.running:
            a = self.accepted(r.accept) if s.k else 0
            if self.predrafted and (r.guess.random() < s.hit_rate if s.hit_rate is not None
                                    else a == s.k and r.guess.random() < s.alpha):
                bets.add(r.rid)
            got[r.rid] = min(a + 1, r.left)
        t += self.u.served_token * sum(got.values())          # the tokens handed on before any answer leaves
        for r in list(self.running):
            r.left -= got[r.rid]
            res.tokens += got[r.rid]
            r.chunks += s.chunks_per_step
            if r.left == 0:
                self.running.remove(r)
                work = self.u.front_request / 2 + self.u.front_chunk * max(1, r.chunks)
                self.push(self.front(t, work), "done", r)
        self.bets = bets
        self.busy = False
        if self.running or self.waiting:
            self.start_step(t)


def simulate(unit: Unit, strategy: Strategy, clients: int, requests: int, new_tokens: int,
             seed: int = 0) -> Result:
    """Serve ``requests`` requests of ``new_tokens`` tokens from ``clients`` closed-loop clients; the cell's
    tok/s is generated tokens over the time the last answer reached its client (as the served suite times it)."""
    if clients < 1 or requests < 1 or new_tokens < 1:
        raise ValueError(f"simulate: clients, requests and new_tokens must be >= 1, got {clients}, {requests}, "
                         f"{new_tokens}")
    return _Sim(unit, strategy, clients, requests, new_tokens, seed).run()


def replicate(unit: Unit, strategy: Strategy, clients: int, requests: int, new_tokens: int,
              seeds: int = 16) -> Result:
    """The cell simulated with seeds 0..seeds-1 and pooled (tokens over seconds of all of them): a served cell
    holds few requests, so one seed's draws of accepted counts move its tok/s by several per cent."""
    runs = [simulate(unit, strategy, clients, requests, new_tokens, seed) for seed in range(seeds)]
    pooled = Result(**{f: sum(getattr(r, f) for r in runs) for f in ("tokens", "seconds", "requests", "steps",
                                                                    "row_steps", "hits")})
    pooled.step_seconds = [x for r in runs for x in r.step_seconds]
    return pooled
