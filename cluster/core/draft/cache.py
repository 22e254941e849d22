"""The speculation cache: next blocks drafted ahead for the outcomes of the verification now running.

Kumar et al., *Speculative Speculative Decoding* (the speculation cache: while the target verifies a block, a
speculator drafts the next block for each outcome it bets on, keyed by that outcome); Liu et al., *PEARL*
(post-verify: the whole block accepted); SwiftSpec (several branches per step).  Verifying a block
``x_1..x_L`` drafted from the committed sequence ``s`` ends in one of

* ``bonus``: all L accepted, then a token t from the target's next distribution: ``s + x + [t]``;
* ``reject`` at j (0 <= j < L): x_1..x_j accepted, then a correction t != x_{j+1}: ``s + x[:j] + [t]``.

A :class:`Branch` bets on one such outcome with a guessed t: the guesser's (a drafter's) ``rank``-th most likely
token at that position (for a rejection, other than x_{j+1}).  The speculator drafts the next block from each
branch's sequence (:mod:`cluster.core.draft.speculator`); the coordinator takes a block only when the committed
sequence is exactly the sequence it was drafted from (:meth:`SpeculationCache.take`), so a block is verified
against its own prefix with the distribution it was drawn from (stored with it): a draw of the draft program at
that prefix, made independently of the target's draws, whichever branch the target's outcome picks.

:class:`FanOut` decides which branches are drafted: per branch key ``(kind, pos, rank)`` the share of steps its
bet came true (Laplace), best first, at most ``rows`` branches per fill; ``rows`` falls when the speculator's
answer came late (the spare core is busy) and rises again while answers are in time.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from cluster.core.draft.programs import DraftBlock, DraftSpec

KINDS = ("bonus", "reject")


class Branch(NamedTuple):
    """One bet on the verification's outcome: ``pos`` draft tokens accepted, then ``token``."""

    kind: str            # bonus (pos = L) | reject (pos < L)
    pos: int
    rank: int            # 0: the guesser's best candidate for that position
    token: int

    @property
    def key(self) -> tuple[str, int, int]:
        """The branch's key for the statistics: ``(kind, pos, rank)``, pos -1 for a bonus (whatever L)."""
        return self.kind, -1 if self.kind == "bonus" else self.pos, self.rank

    def expect(self, seq: list[int], block: list[int]) -> list[int]:
        """The committed sequence this branch bets on, after verifying ``block`` drafted from ``seq``."""
        return list(seq) + list(block[:self.pos]) + [self.token]


def candidates(block: list[int], rows: torch.Tensor, keys: list[tuple[str, int, int]]) -> list[Branch]:
    """The branches named by ``keys`` (in that order; :attr:`Branch.key`) for ``block`` [L], from the guesser's
    scores ``rows`` [L+1, V] (row j: its scores for the token at position j of the block, row L: after the
    block).  A rejection key past the block's end is skipped."""
    L = len(block)
    width = 1 + max((r for _, _, r in keys), default=0)
    order = rows.topk(min(width + 1, rows.shape[-1]), dim=-1).indices.tolist()      # [L+1, width+1]
    out = []
    for kind, pos, rank in keys:
        pos = L if kind == "bonus" else pos
        if not 0 <= pos <= L or (kind == "reject" and pos == L):
            continue
        alts = [t for t in order[pos] if pos == L or t != block[pos]]
        if rank < len(alts):
            out.append(Branch(kind, pos, rank, alts[rank]))
    return out


@dataclass
class Entry:
    """A block drafted ahead: valid when the committed sequence is ``expect`` and the step asks ``spec``."""

    expect: list[int]
    spec: DraftSpec
    block: DraftBlock
    key: tuple[str, int, int]


@dataclass
class FanOut:
    """Which branches to draft (see the module docstring).  ``rows``: branches per fill, within
    [``min_rows``, ``max_rows``]; ``width``: candidates per position considered."""

    rows: int = 4
    min_rows: int = 1
    max_rows: int = 8
    width: int = 2
    in_time: int = 0                           # answers in time since ``rows`` last changed
    tries: Counter = field(default_factory=Counter)
    hits: Counter = field(default_factory=Counter)

    RAISE_AFTER = 4                            # answers in time before one more branch is tried

    def keys(self, length: int) -> list[tuple[str, int, int]]:
        """The branch keys to draft for blocks of up to ``length`` tokens, best first, ``rows`` of them (ties: the
        guesser's best candidates first, the bonus, then later positions)."""
        every = [("bonus", -1, r) for r in range(self.width)] + \
                [("reject", j, r) for j in range(length) for r in range(self.width)]
        every.sort(key=lambda k: (-self.rate(k), k[2], k[0] != "bonus", -k[1]))
        return every[:self.rows]

    def rate(self, key) -> float:
        return (self.hits[key] + 1) / (self.tries[key] + 2)

    def outcome(self, tried: list[tuple[str, int, int]], hit: tuple[str, int, int] | None) -> None:
        """A fill's branches for one request were ``tried``; ``hit`` is the one the target's outcome picked."""
        self.tries.update(tried)
        if hit is not None:
            self.hits[hit] += 1

    def answered(self, in_time: bool) -> None:
        """The speculator's answer for the last fill was there when the next step asked (or not)."""
        if not in_time:
            self.rows, self.in_time = max(self.min_rows, self.rows - 1), 0
            return
        self.in_time += 1
        if self.in_time >= self.RAISE_AFTER and self.rows < self.max_rows:
            self.rows, self.in_time = self.rows + 1, 0


@dataclass
class CacheCounters:
    """What the cache did: ``steps`` blocks asked for (speculative steps, per request), ``hits`` by branch kind,
    ``late`` steps whose answer had not arrived, ``wasted`` draft tokens drafted ahead and not used, ``rows``
    branches drafted over ``fills`` fills (the fan-out)."""

    steps: int = 0
    hits: Counter = field(default_factory=Counter)
    late: int = 0
    wasted: int = 0
    rows: int = 0
    fills: int = 0
    calls: int = 0               # draft_batch calls, and their seconds in the coordinator (near drafting included)
    call_s: float = 0.0
    hit_calls: int = 0           # calls every block of which came from the cache, and their seconds
    hit_s: float = 0.0

    def as_dict(self) -> dict:
        return dict(steps=self.steps, **{f"hits_{k}": self.hits[k] for k in KINDS}, late=self.late,
                    wasted=self.wasted, rows=self.rows, fills=self.fills, calls=self.calls, call_s=self.call_s,
                    hit_calls=self.hit_calls, hit_s=self.hit_s)


class SpeculationCache:
    """The coordinator's cache: the speculator's blocks for the last fill, per request (see the module docstring)."""

    def __init__(self):
        self._entries: dict[str, list[Entry]] = {}
        self.counters = CacheCounters()

    def put(self, rid: str, entries: list[Entry]) -> None:
        self._entries[rid] = list(entries)

    def take(self, rid: str, seq: list[int], spec: DraftSpec) -> tuple[Entry | None, list[Entry]]:
        """The entry drafted from exactly ``seq`` for ``spec`` (else None), and all the request's entries: they
        are gone afterwards (each was for this step only)."""
        entries = self._entries.pop(rid, [])
        hit = next((e for e in entries if e.expect == seq and e.spec == spec and e.block.tokens), None)
        return hit, entries

    def drop(self, rid: str) -> None:
        self._entries.pop(rid, None)

    def clear(self) -> None:
        """Forget every entry and reset the counters."""
        self._entries.clear()
        self.counters = CacheCounters()
