"""The speculator: drafts the next block for each outcome of the verification now running, to fill the
coordinator's speculation cache (:mod:`cluster.core.draft.cache`; Kumar et al., *Speculative Speculative
Decoding*, the speculator filling the speculation cache; Liu et al., *PEARL*; SwiftSpec's branches).

One :class:`Fill` names, per request, the committed sequence, the block the target is verifying and the drafter's
next-best tokens per position of it (recorded when it was drafted, :attr:`DraftBlock.alts`); the speculator drafts
the next block of every branch (:func:`cluster.core.draft.cache.candidates`) with its own draft side (its own copy
of the drafters, the Max-Gram index and the cascade: the same draft programs as the coordinator's), all branches of
all requests as requests of ONE draft side, so each drafting round is one batched drafter forward of all branch
rows.  The bonus branch continues the block itself and drafts one token more: its first token is the bet on the
bonus, the rest its block (PEARL's pre-draft).  A branch is a request ``rid|i`` of that side, kept between fills:
moving it to its next bet is one rollback to the common prefix and one extend (the drafters' caches are cropped,
not refilled).  Blocks are at most ``Fill.depth`` tokens (the fan-out's choice: an answer must come within one
verification).  A ``then`` item bets on nothing: it is a miss step's own sequence, sent before the coordinator
drafts near, drafted ``limit`` deep as branch ``rid|0`` (a :data:`cluster.core.draft.cache.KNOWN` entry), and the
look-ahead (:meth:`Speculator.ahead`) then bets on the fill that verifies that block.

``stop`` (asked between drafting rounds): a newer fill has arrived, give up.  Blocks are drawn from the
speculator's own random streams, independent of the target's draws; a block is only used for the exact sequence
it was drafted from (:meth:`cluster.core.draft.cache.SpeculationCache.take`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from cluster.core.calls import PrefillItem
from cluster.core.draft.cache import KNOWN, Entry, candidates
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
    alts: list[list[int]] | None = None    # [L][W] the drafter's next-best tokens per position of ``block``
    then: bool = False           # ``seq`` is this step's (no block, no bets): draft ``limit``; the next fill bets
    salt: str = ""               # the request's cache salt (its branches are prefilled with it)
                                 # on the block drafted here


@dataclass
class Fill:
    """What the speculator is asked to draft ahead; ``keys``: the branches per request, best first
    (:class:`cluster.core.draft.cache.FanOut`); ``released``: requests that ended since the last fill."""

    id: int
    items: list[FillItem]
    keys: list[tuple[str, int, int]]
    released: list[str] = field(default_factory=list)
    depth: int = 64                         # draft tokens per branch block at most


@dataclass
class Reply:
    """The blocks drafted for fill ``id``, per request; ``rows`` branches drafted, ``tokens`` draft tokens."""

    id: int
    entries: dict[str, list[Entry]]
    rows: int = 0
    tokens: int = 0
    compute_s: float = 0.0                  # the speculator's seconds on this fill (set by its host)
    ahead: int = 0                          # requests answered from blocks drafted ahead (:meth:`Speculator.ahead`)


def _branch_rid(rid: str, i: int | str) -> str:
    return f"{rid}|{i}"


class Speculator:
    """See the module docstring.  ``members``: drafter name -> handle (its own copies); ``alts``: next-best tokens
    recorded per position of the blocks it drafts (the next fill's rejection bets when one is used)."""

    def __init__(self, members: dict, *, rng_factory=Rng, alts: int = 1):
        self.side = DraftSide(members, rng_factory=rng_factory, sampled=True, alts=alts)
        self._at: dict[str, list[int]] = {}       # branch id -> the committed sequence it was moved to
        self._branches: dict[str, set[str]] = {}  # rid -> its branch ids
        self._next = None       # the last fill's (items, keys, depth, entries): what :meth:`ahead` predicts from
        self._pred: dict = {}   # rid -> the predicted item of the look-ahead last started
        self._ahead: dict = {}  # rid -> the entries that look-ahead drafted in full for it
        self._bets = [("bonus", -1, 0)]   # the last branches a fill bet on (a look-ahead after ``then`` items)

    def fill(self, fill: Fill, stop=None) -> Reply:
        for rid in fill.released:
            self.release(rid)
        items = [it for it in fill.items if it.block or it.then]
        if not items or not fill.keys:
            self._next = None
            return Reply(fill.id, {})
        keys = self._keys(fill, items)
        if any(k != KNOWN for k in fill.keys):
            self._bets = list(fill.keys)
        ready = {it.rid: self._ahead[it.rid] for it in items
                 if it.rid in self._ahead and self._pred.get(it.rid) == _drafts(it)}
        self._ahead = {}
        out, rows, tokens = self._draft([it for it in items if it.rid not in ready], keys, fill.depth, stop)
        for rid, entries in ready.items():            # (counted as drafted for this fill: they were, ahead of it)
            out[rid] = entries
            rows, tokens = rows + len(entries), tokens + sum(len(e.block.tokens) for e in entries)
        self._next = (items, keys, fill.depth, out)
        return Reply(fill.id, out, rows, tokens, ahead=len(ready))

    def predicted(self, fill: Fill) -> bool:
        """Whether :meth:`ahead` is drafting (or drafted) for exactly ``fill``'s items: every item as predicted,
        whatever branches and depth the fill asks (see :meth:`ahead`)."""
        items = [it for it in fill.items if it.block or it.then]
        return bool(items and fill.keys) and not fill.released and all(
            self._pred.get(it.rid) == _drafts(it) for it in items)

    @staticmethod
    def _keys(fill: Fill, items: list) -> list:
        return fill.keys[:max(1, len(fill.keys) // len(items))]

    def ahead(self, stop=None) -> int:
        """Between fills: draft the next fill's branches for the likeliest outcome of the last one -- each request's
        bonus branch came true (its whole block accepted, the bet on the bonus right) and the coordinator verifies
        the block drafted for it -- so that fill, when it comes as predicted, is answered at once (PEARL's drafting
        that never waits for verification, one step further).  Kept per request only when drafted in full; used
        only for a fill item equal to the predicted one, with the last fill's branches and depth even where the fill
        asks others: the fan-out moves with every late answer (:class:`cluster.core.draft.cache.FanOut`), and
        asking for its exact branches again threw the look-ahead away whenever it had moved.  Each block is exact
        for the sequence it was drafted from whichever branches were asked.  After ``then`` items the likeliest next
        fill verifies exactly the block drafted for each (near drafts the same greedy block), with the last bets'
        branches.  Returns the requests drafted ahead."""
        last, self._next = self._next, None
        if last is None:
            return 0
        items, keys, depth, out = last
        pred = []
        for it in items:
            e = next((e for e in out.get(it.rid, ()) if e.key[0] == ("known" if it.then else "bonus")), None)
            if e is not None and it.then:            # the fill that verifies this very block comes next
                pred.append(FillItem(it.rid, list(it.seq), it.sampling, it.seed, it.spec, list(e.block.tokens),
                                     it.limit, it.budget, e.block.alts, salt=it.salt))
            elif e is not None:
                budget = it.budget - len(it.block) - 1
                pred.append(FillItem(it.rid, list(e.expect), it.sampling, it.seed, it.spec, list(e.block.tokens),
                                     min(it.limit, budget - 1), budget, e.block.alts, salt=it.salt))
        self._pred = {it.rid: _drafts(it) for it in pred}
        if any(it.then for it in items):
            keys = self._bets
        self._ahead, _, _ = self._draft(pred, keys, depth, stop, whole=True)
        return len(self._ahead)

    def _draft(self, items: list[FillItem], keys: list, depth: int, stop=None, whole: bool = False):
        """The blocks of ``items``' branches ``keys`` as one batch: ({rid: entries}, rows, tokens); ``whole``: a
        request whose branches were not all drafted in full (``stop``) gets none."""
        runs, where = [], []
        for it in items:
            if it.then:                                   # the step's own sequence: no outcome to bet on
                if it.limit >= 1:
                    runs.append((self._move(it, 0, it.seq), it.spec, it.limit, it.budget))
                    where.append((it, None))
                continue
            for i, br in enumerate(candidates(it.block, it.alts, keys)):
                nxt = min(it.limit, depth, it.budget - br.pos - 2)   # the next step's limit on this outcome
                if nxt >= 1:
                    bonus = br.token is None                             # one token more: the bet, then the block
                    runs.append((self._move(it, i, br.start(it.seq, it.block)), it.spec, nxt + bonus,
                                 it.budget - br.pos - 1 + bonus))
                    where.append((it, br))
        blocks = self.side.draft_batch(runs, stop=stop) if runs else []
        out: dict[str, list[Entry]] = {}
        short: set[str] = set()
        tokens = 0
        for (it, br), block, run in zip(where, blocks, runs):
            if not isinstance(block, DraftBlock) or len(block.tokens) < run[2]:
                short.add(it.rid)
            if br is None:
                if isinstance(block, DraftBlock) and block.tokens:
                    out.setdefault(it.rid, []).append(Entry(list(it.seq), it.spec, block, KNOWN))
                    tokens += len(block.tokens)
                continue
            if not isinstance(block, DraftBlock) or len(block.tokens) < 1 + (br.token is None):
                continue
            expect = br.start(it.seq, it.block)
            if br.token is None:
                expect, block = expect + block.tokens[:1], block.tail(1, len(block.tokens) - 1)
            out.setdefault(it.rid, []).append(Entry(expect, it.spec, block, br.key))
            tokens += len(block.tokens)
        if whole:
            out = {rid: e for rid, e in out.items() if rid not in short}
        return out, len(runs), tokens

    def release(self, rid: str) -> None:
        self._ahead.pop(rid, None)
        for prid in self._branches.pop(rid, ()):
            self.side.release(prid)
            self._at.pop(prid, None)

    def active_requests(self) -> list[str]:
        return list(self._branches)

    def _move(self, it: FillItem, i: int | str, seq: list[int]) -> str:
        """Branch ``i`` of ``it``'s request, now at committed sequence ``seq`` (prefilled the first time)."""
        prid = _branch_rid(it.rid, i)
        at = self._at.get(prid)
        if at is None:
            self.side.prefill_batch([PrefillItem(prid, list(seq), it.sampling, derive_seed(it.seed, f"speculator-{i}"),
                                                 it.salt)])
        else:
            c = _common(at, seq)
            self.side.rollback(prid, c)
            self.side.extend(prid, list(seq[c:]))
        self._at[prid] = list(seq)
        self._branches.setdefault(it.rid, set()).add(prid)
        return prid


def _drafts(it: FillItem) -> FillItem:
    """``it`` as far as it decides what is drafted: its budget matters only up to ``limit + len(block) + 2`` (every
    branch's block is then ``limit`` long at most, :meth:`Speculator._draft`)."""
    return replace(it, budget=min(it.budget, it.limit + len(it.block) + 2))


def _common(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
