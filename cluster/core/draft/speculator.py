"""The speculator: drafts the next block for each outcome of the verification now running, to fill the
coordinator's speculation cache (:mod:`cluster.core.draft.cache`; Kumar et al., *Speculative Speculative
Decoding*, the speculator filling the speculation cache; SwiftSpec's branches).

One :class:`Fill` names, per request, the committed sequence and the block the target is verifying; the speculator

1. scores every block with the **guesser** (the first neural drafter: one batched forward over all requests,
   rows ``[L+1, V]``) -- its best candidates per position are the bets (:func:`cluster.core.draft.cache.candidates`);
2. drafts the next block of every branch with its own draft side (its own copy of the drafters, the Max-Gram
   index and the cascade: the same draft programs as the coordinator's), all branches of all requests as
   requests of ONE draft side, so each drafting round is one batched drafter forward of all branch rows.  A
   branch is a request ``rid|i`` of that side, kept between fills: moving it to its next bet is one rollback to
   the common prefix and one extend (the drafters' caches are cropped, not refilled).

``stop`` (asked between drafting rounds): a newer fill has arrived, give up and answer what is done.  Blocks are
drawn from the speculator's own random streams, independent of the target's draws; a block is only used for the
exact sequence it was drafted from (:meth:`cluster.core.draft.cache.SpeculationCache.take`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.core.draft.cache import Entry, candidates
from cluster.core.draft.programs import DraftBlock, DraftSpec
from cluster.core.draft.side import DraftSide
from cluster.core.sampling import Rng, SamplingParams, derive_seed


@dataclass
class FillItem:
    """One request's step: ``block`` (being verified) was drafted from ``seq`` (committed) with ``spec``."""

    rid: str
    seq: list[int]
    sampling: SamplingParams
    seed: int
    spec: DraftSpec
    block: list[int]
    limit: int                   # the step's draft length (the next step asks the same)
    budget: int                  # tokens the request may still emit this step


@dataclass
class Fill:
    """What the speculator is asked to draft ahead; ``keys``: the branches per request, best first
    (:class:`cluster.core.draft.cache.FanOut`); ``released``: requests that ended since the last fill."""

    id: int
    items: list[FillItem]
    keys: list[tuple[str, int, int]]
    released: list[str] = field(default_factory=list)


@dataclass
class Reply:
    """The blocks drafted for fill ``id``, per request; ``rows`` branches drafted, ``tokens`` draft tokens."""

    id: int
    entries: dict[str, list[Entry]]
    rows: int = 0
    tokens: int = 0


def _branch_rid(rid: str, i: int) -> str:
    return f"{rid}|{i}"


class Speculator:
    """See the module docstring.  ``members``: drafter name -> handle (its own copies)."""

    def __init__(self, members: dict, *, rng_factory=Rng, guesser: str | None = None):
        self.side = DraftSide(members, rng_factory=rng_factory, sampled=True)
        neural = [n for n, h in self.side.members.items() if not h.deterministic]
        self.guesser = guesser or (neural[0] if neural else None)
        self._held: dict[str, list[int]] = {}     # guesser row id -> tokens it holds
        self._at: dict[str, list[int]] = {}       # branch id -> the committed sequence it was moved to
        self._branches: dict[str, set[str]] = {}  # rid -> its branch ids

    def fill(self, fill: Fill, stop=None) -> Reply:
        for rid in fill.released:
            self.release(rid)
        items = [it for it in fill.items if it.block]
        if self.guesser is None or not items or not fill.keys:
            return Reply(fill.id, {})
        rows = self._guess(items)
        per = max(1, len(fill.keys) // len(items))
        runs, where = [], []
        for it, scores in zip(items, rows):
            for i, br in enumerate(candidates(it.block, scores, fill.keys[:per])):
                nxt = min(it.limit, it.budget - br.pos - 2)          # the next step's limit on this outcome
                if nxt >= 1:
                    prid = self._move(it, i, br.expect(it.seq, it.block))
                    runs.append((prid, it.spec, nxt, it.budget - br.pos - 1))
                    where.append((it, br))
        blocks = self.side.draft_batch(runs, stop=stop) if runs else []
        out: dict[str, list[Entry]] = {}
        tokens = 0
        for (it, br), block in zip(where, blocks):
            if isinstance(block, DraftBlock) and block.tokens:
                out.setdefault(it.rid, []).append(Entry(br.expect(it.seq, it.block), it.spec, block, br.key))
                tokens += len(block.tokens)
        return Reply(fill.id, out, len(runs), tokens)

    def release(self, rid: str) -> None:
        for prid in self._branches.pop(rid, ()):
            self.side.release(prid)
            self._at.pop(prid, None)
        grid = _branch_rid(rid, -1)
        if self._held.pop(grid, None) is not None:
            self.side.members[self.guesser].release(grid)

    def active_requests(self) -> list[str]:
        return list(self._branches)

    def _guess(self, items: list[FillItem]) -> list:
        """The guesser's scores of every item's block, one batched forward: ``[L+1, V]`` each."""
        g = self.side.members[self.guesser]
        new = [it for it in items if _branch_rid(it.rid, -1) not in self._held]
        if new:
            g.prefill_batch([(_branch_rid(it.rid, -1), list(it.seq), it.sampling, it.seed) for it in new])
            for it in new:
                self._held[_branch_rid(it.rid, -1)] = list(it.seq)
        for it in items:
            grid = _branch_rid(it.rid, -1)
            held = self._held[grid]
            c = _common(held, it.seq)
            if c < len(held):
                g.rollback(grid, c)
            if c < len(it.seq):
                g.extend(grid, list(it.seq[c:]))
            self._held[grid] = list(it.seq) + list(it.block)
            self._branches.setdefault(it.rid, set())
        return g.score_batch([(_branch_rid(it.rid, -1), list(it.block)) for it in items])

    def _move(self, it: FillItem, i: int, seq: list[int]) -> str:
        """Branch ``i`` of ``it``'s request, now at committed sequence ``seq`` (prefilled the first time)."""
        prid = _branch_rid(it.rid, i)
        at = self._at.get(prid)
        if at is None:
            self.side.prefill_batch([(prid, list(seq), it.sampling, derive_seed(it.seed, f"speculator-{i}"))])
        else:
            c = _common(at, seq)
            self.side.rollback(prid, c)
            self.side.extend(prid, list(seq[c:]))
        self._at[prid] = list(seq)
        self._branches.setdefault(it.rid, set()).add(prid)
        return prid


def _common(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
