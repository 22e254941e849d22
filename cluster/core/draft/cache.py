"""The speculation cache: next blocks drafted ahead for the outcomes of the verification now running.

Kumar et al., *Speculative Speculative Decoding* (the speculation cache: while the target verifies a block, a
speculator drafts the next block for each outcome it bets on, keyed by that outcome); Liu et al., *PEARL*
(post-verify: the whole block accepted); SwiftSpec (several branches per step).  Verifying a block
``x_1..x_L`` drafted from the committed sequence ``s`` ends in one of

* ``bonus``: all L accepted, then a token t from the target's next distribution: ``s + x + [t]``;
* ``reject`` at j (0 <= j < L): x_1..x_j accepted, then a correction t != x_{j+1}: ``s + x[:j] + [t]``.

A :class:`Branch` bets on one such outcome with a guessed t: for a rejection at j the drafter's ``rank``-th best
token other than x_{j+1} (recorded with the block as it was drafted, :attr:`DraftBlock.alts`: no extra forward);
for the bonus the speculator's own next draft after the block (its first drafted token, PEARL's guess).  The
speculator drafts the next block from each branch's sequence (:mod:`cluster.core.draft.speculator`), all branches
as one batch; the coordinator takes a block only when the committed
sequence is exactly the sequence it was drafted from (:meth:`SpeculationCache.take`), so a block is verified
against its own prefix with the distribution it was drawn from (stored with it): a draw of the draft program at
that prefix, made independently of the target's draws, whichever branch the target's outcome picks.

:class:`FanOut` decides which branches are drafted: per branch key ``(kind, pos, rank)`` the share of steps its
bet came true (Laplace), best first, at most ``rows`` branches per fill, each at most ``depth`` tokens; both fall
when the speculator's answer came late (the spare core is busy: an answer must arrive within one verification)
and rise again while answers are in time.

A ``known`` entry bets on nothing: a miss step sends its own committed sequence before the coordinator drafts near
(the speculator's ``then`` items, :meth:`cluster.core.draft.near_far.NearFarSide._outcome`); the block drafted
from it is a hit whenever it arrives before near has drafted (:mod:`cluster.core.draft.race`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from cluster.core.draft.programs import DraftBlock, DraftSpec

KINDS = ("bonus", "reject", "known")
KNOWN = ("known", -1, 0)     # the key of a block drafted from a committed sequence (no bet: a ``then`` item)


class Branch(NamedTuple):
    """One bet on the verification's outcome: ``pos`` draft tokens accepted, then ``token`` (None for the bonus: the
    speculator's own next draft after the block is the bet, drafted as the first token of that branch's block)."""

    kind: str            # bonus (pos = L) | reject (pos < L)
    pos: int
    rank: int            # 0: the drafter's best candidate for that position
    token: int | None

    @property
    def key(self) -> tuple[str, int, int]:
        """The branch's key for the statistics: ``(kind, pos, rank)``, pos -1 for a bonus (whatever L)."""
        return self.kind, -1 if self.kind == "bonus" else self.pos, self.rank

    def start(self, seq: list[int], block: list[int]) -> list[int]:
        """The sequence the branch's drafting continues: ``seq + block[:pos] (+ [token])``."""
        return list(seq) + list(block[:self.pos]) + ([] if self.token is None else [self.token])


def candidates(block: list[int], alts: list[list[int]] | None, keys: list[tuple[str, int, int]]) -> list[Branch]:
    """The branches named by ``keys`` (in that order; :attr:`Branch.key`) for ``block`` [L]: the bonus (rank 0
    only: the speculator's own next draft), and rejections at j with ``alts[j][rank]``, the drafter's next-best
    tokens at j (:attr:`cluster.core.draft.programs.DraftBlock.alts`; None: no rejection bets).  Keys that do not
    fit the block (past its end, beyond the alternatives recorded) are skipped."""
    L = len(block)
    out = []
    for kind, pos, rank in keys:
        if kind == "bonus":
            if rank == 0:
                out.append(Branch("bonus", L, 0, None))
        elif alts is not None and 0 <= pos < min(L, len(alts)) and rank < len(alts[pos]):
            out.append(Branch("reject", pos, rank, alts[pos][rank]))
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
    """Which branches to draft, and how far (see the module docstring).  ``rows``: branches per fill, within
    [``min_rows``, ``max_rows``]; ``depth``: draft tokens per branch block, within [``min_depth``, ``max_depth``]
    (the coordinator keeps ``max_depth`` at the steps' draft length); ``width``: alternatives per position."""

    rows: int = 3
    depth: int = 4
    min_rows: int = 1
    max_rows: int = 6
    min_depth: int = 2
    max_depth: int = 4
    width: int = 1
    in_time: int = 0                           # answers in time since the fan-out last changed
    on_time: float = 1.0                       # moving share of answers in time (the last ~8)
    steps: int = 0                             # steps since the speculator was last asked (backing off)
    probing: int = 0                           # fills of the probe under way still to send
    tries: Counter = field(default_factory=Counter)
    hits: Counter = field(default_factory=Counter)

    RAISE_AFTER = 4                            # answers in time before the fan-out grows by one step
    BACK_OFF_BELOW = 0.5                       # back off while fewer answers than this share come in time ...
    PROBE_EVERY = 8                            # ... asking the speculator every this many steps only,
    PROBE_FILLS = 2                            # ... this many steps in a row (the first catches it up)
    SMOOTHING = 1 / 8                          # weight of the latest answer in ``on_time``

    def ask(self) -> bool:
        """Whether to send this step's fill: always, unless at the least fan-out most answers still come late
        (``on_time`` < ``BACK_OFF_BELOW``) -- the speculator has no spare core (it shares the coordinator's, or
        the machine is loaded) and its drafting would only slow the coordinator -- then ``PROBE_FILLS`` steps in a
        row every ``PROBE_EVERY`` steps, until answers come in time again: the first fill of a probe brings the
        speculator up to date with the steps it was not asked about, so only the next one says whether its answers
        can come in time (the near side judges only those)."""
        if not self.backing_off:
            self.steps = self.probing = 0
            return True
        self.steps += 1
        if self.steps >= self.PROBE_EVERY:
            self.steps, self.probing = 0, self.PROBE_FILLS
        if self.probing:
            self.probing -= 1
            return True
        return False

    @property
    def fill_depth(self) -> int:
        """Draft tokens per branch block for the next fill: ``depth``, at most ``max_depth`` (the steps' length)."""
        return min(self.depth, self.max_depth)

    @property
    def backing_off(self) -> bool:
        """At the least fan-out with most answers late (see :meth:`ask`)."""
        return self.rows <= self.min_rows and self.depth <= self.min_depth and self.on_time < self.BACK_OFF_BELOW

    def keys(self, length: int) -> list[tuple[str, int, int]]:
        """The branch keys to draft for blocks of up to ``length`` tokens, best first, ``rows`` of them (ties: the
        bonus, then the drafter's best alternatives, then later positions)."""
        every = [("bonus", -1, 0)] + [("reject", j, r) for j in range(length) for r in range(self.width)]
        every.sort(key=lambda k: (-self.rate(k), k[0] != "bonus", k[2], -k[1]))
        return every[:self.rows]

    def rate(self, key) -> float:
        return (self.hits[key] + 1) / (self.tries[key] + 2)

    def outcome(self, tried: list[tuple[str, int, int]], hit: tuple[str, int, int] | None) -> None:
        """A fill's branches for one request were ``tried``; ``hit`` is the one the target's outcome picked."""
        self.tries.update(tried)
        if hit is not None:
            self.hits[hit] += 1

    def answered(self, in_time: bool) -> None:
        """The speculator's answer for the last fill was there when the next step asked (or not): late, fewer
        rows first (down to 2), then shallower blocks, then one row; in time ``RAISE_AFTER`` times, deeper
        blocks first, then more rows."""
        self.depth = self.fill_depth
        self.on_time += self.SMOOTHING * (float(in_time) - self.on_time)
        if not in_time:
            self.in_time = 0
            if self.rows > max(2, self.min_rows):
                self.rows -= 1
            elif self.depth > self.min_depth:
                self.depth -= 1
            else:
                self.rows = max(self.min_rows, self.rows - 1)
            return
        self.in_time += 1
        if self.in_time >= self.RAISE_AFTER:
            self.in_time = 0
            if self.depth < self.max_depth:
                self.depth += 1
            elif self.rows < self.max_rows:
                self.rows += 1


@dataclass
class CacheCounters:
    """What the cache did: ``steps`` blocks asked for (speculative steps, per request), ``hits`` by branch kind,
    ``late`` steps whose answer had not arrived when they began, ``wasted`` draft tokens drafted ahead and not used, ``rows``
    branches drafted over ``fills`` fills (the fan-out)."""

    steps: int = 0
    hits: Counter = field(default_factory=Counter)
    late: int = 0
    late_fills: int = 0
    wasted: int = 0
    rows: int = 0
    fills: int = 0
    calls: int = 0               # draft_batch calls, and their seconds in the coordinator (near drafting included)
    call_s: float = 0.0
    hit_calls: int = 0           # calls every block of which came from the cache, and their seconds
    hit_s: float = 0.0
    gap_s: float = 0.0           # fills sent -> the next call (the time an answer has), and the speculator's
    fill_s: float = 0.0          # seconds on the fills answered in time (``fills`` of each)
    raced: int = 0               # hits (of ``hits``) from a late answer that came while near drafted, and the
    raced_rounds: int = 0        # near drafting rounds (tokens, for a neural drafter) done before it came
    ahead: int = 0               # requests of the fills answered in time whose blocks were drafted ahead of the fill
    short: int = 0               # right bets not taken: shorter than asked, in a step that drafted near anyway

    def as_dict(self) -> dict:
        return dict(steps=self.steps, **{f"hits_{k}": self.hits[k] for k in KINDS}, late=self.late,
                    late_fills=self.late_fills, wasted=self.wasted, rows=self.rows, fills=self.fills, calls=self.calls, call_s=self.call_s,
                    hit_calls=self.hit_calls, hit_s=self.hit_s, gap_s=self.gap_s, fill_s=self.fill_s,
                    raced=self.raced, raced_rounds=self.raced_rounds, ahead=self.ahead,
                    short=self.short)


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
