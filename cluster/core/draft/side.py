"""The draft side: every drafter of a unit behind one handle that drafts a whole block per request per call.

The engine sees one model, :data:`cluster.core.draft.programs.DRAFTS`, with one batched method, ``draft_batch``:
items ``(request id, DraftSpec, limit, budget)`` -> one :class:`DraftBlock` each.  The draft programs of all
the call's requests run together, their drafter calls grouped per drafter into one batched call per round.
In-process it wraps the local drafter handles; served, it lives in one Ray actor with the drafters
(:mod:`actors.draft_actor`), so a step costs one round trip to the draft side whatever the strategy.

**Commits.**  The strategy tells the draft side what the target committed the way it tells any handle:
``rollback(rid, len(tokens) + accepted)`` then ``extend(rid, new)`` -- lengths counted over the committed
sequence followed by the last block it drafted.  No drafter is touched then; each is brought to the
sequence it is asked about when next used (``sync``: one rollback + extend, no forward pass).  A drafter is
prefilled the first time a request uses it (lazily, batched per drafter).

**Overlap** (``overlap=True``; Liu et al., *PEARL: Parallel Speculative Decoding with Adaptive Draft
Length*, "post-verify"; Timor et al., *Distributed Speculative Inference*: the target never waits).
After answering a call, :meth:`predraft` drafts each request's NEXT block on the assumption that the
target accepts the whole block just sent and that its bonus token is the draft side's own next token g:
the program runs from committed + block with one more token, whose first token is g.  When the next call
finds exactly committed + block + [g] committed, the rest is the answer (drafted while the target
verified); otherwise it is dropped and drafting starts from the true prefix.  Losslessness is untouched:
a block is only ever verified against the prefix it was drafted from, with the distributions it was drawn
from, and the draws that made it are independent of the target's draws that decide whether it is used.
Where the draft side shares a process with the target (in-process) nothing runs concurrently, so overlap
is off there unless forced (the exact-enumeration tests force it to cover the path).  Only greedy requests
are pre-drafted unless ``sampled=True`` (see ``__init__``): a seed then reproduces a sampled request's
tokens in every runtime.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from cluster.core.calls import DraftItem, PrefillItem, drive
from cluster.core.draft.programs import DRAFTS, DraftBlock, DraftCtx, DraftSpec, run_program
from cluster.core.interfaces import BatchedHandle, UnknownRequestError, UnsupportedCallError
from cluster.core.sampling import Rng, SamplingParams, derive_seed
from cluster.errors import ModelUnavailableError


@dataclass
class _Pre:
    """A pre-drafted next block: valid when the committed sequence becomes ``expect``."""

    expect: list[int]
    spec: DraftSpec
    block: DraftBlock            # starts at the bonus guess g (token 0)


class _Run(NamedTuple):
    """One draft program to run: ``key`` orders the answers."""

    key: int
    rid: str
    spec: DraftSpec
    work: list[int]              # [W] tokens past the committed sequence the program continues (a guessed block)
    limit: int                   # at most this many tokens


def _gone(model: str, error: Exception) -> None:
    """A drafter that is gone takes the whole draft side down (the engine then marks it down)."""
    if isinstance(error, ModelUnavailableError):
        raise error


@dataclass
class _Req:
    seq: list[int]                          # committed tokens, as the engine told us
    sampling: SamplingParams
    seed: int
    last: list[int] = field(default_factory=list)    # the block last answered (not committed)
    held: dict[str, list[int]] = field(default_factory=dict)   # drafter -> tokens it holds
    agreed: dict[str, int] = field(default_factory=dict)       # drafter -> prefix known equal to seq
    pre: _Pre | None = None
    tries: int = 0                          # pre-drafted blocks this request got, and how many were used
    hits: int = 0
    salt: str = ""                          # the request's cache salt (its drafters are prefilled with it)

    def worth_predrafting(self, min_hit: float, probe_every: int) -> bool:
        """Pre-draft while the request's pre-drafts come true often enough (Laplace estimate >= min_hit;
        a pre-draft that misses costs draft-side work, free only while that side would idle), and probe
        every ``probe_every``-th step otherwise, so a request whose drafts become predictable is noticed."""
        return (self.hits + 1) / (self.tries + 2) >= min_hit or self.tries % probe_every == 0


class DraftSide(BatchedHandle):
    """See the module docstring.  ``members``: drafter name -> handle (batched forms where they have them)."""

    name = DRAFTS

    MIN_HIT = 0.3          # pre-draft a request's next block while at least this share of its pre-drafts is used
    PROBE_EVERY = 8
    MAX_ROWS = 8           # pre-draft only for calls of at most this many requests (under load the draft side
                           # is busy and a wasted pre-draft is not free)

    def __init__(self, members: dict, *, overlap: bool = False, deferred: bool = False, rng_factory=Rng,
                 sampled: bool = False, alts: int = 0):
        if not members:
            raise ValueError("a draft side needs at least one drafter")
        self.members = dict(members)
        # sampled: pre-draft sampled requests too (exact either way; the tests prove it).  Off by default so a
        # sampled request's draws follow one stream whatever the runtime: a seed gives the same tokens
        # in-process and served (a pre-draft that is dropped would have consumed draws)
        self.sampled = sampled
        # deferred: the host calls predraft() after answering (an actor, while the target verifies); else
        # draft_batch pre-drafts before it returns (in-process: same blocks, nothing gained, path covered)
        self.overlap, self.deferred = overlap, deferred
        self.rng_factory, self.alts = rng_factory, alts    # alts: next-best tokens kept per position (a speculator's)
        self.vocab_size = min(h.vocab_size for h in self.members.values())
        self.max_length = min(h.max_length for h in self.members.values())
        self.num_params = sum(int(h.num_params) for h in self.members.values())
        self._reqs: dict[str, _Req] = {}
        self._todo: list[tuple[DraftItem, DraftBlock]] = []   # the last call's answered blocks, to pre-draft after
        self._drafting: dict[str, list[int]] = {}   # while predraft runs: rid -> the prefix its block continues
        self.hits = self.misses = 0            # pre-drafted blocks used / dropped

    # -- the handle protocol ------------------------------------------------------------------------
    def prefill_batch(self, items: list[tuple]) -> None:
        """Items: :class:`cluster.core.calls.PrefillItem` (or 4-tuples: no salt); no drafter is touched yet."""
        for item in items:
            rid, ids, sampling, seed, salt = PrefillItem.of(item)
            self.release(rid)
            self._reqs[rid] = _Req(list(ids), sampling, seed, salt=salt)

    def score_batch(self, items) -> list:
        """The draft side drafts blocks (``draft_batch``); a strategy scores on one drafter, its member."""
        raise UnsupportedCallError(self.name, "score_batch")

    def rollback(self, rid: str, length: int) -> None:
        """The committed sequence becomes (committed + the last block)[:length]."""
        st = self.request(rid)
        st.seq = (st.seq + st.last)[:length] if length > len(st.seq) else st.seq[:length]
        st.last = []
        for name in st.agreed:
            st.agreed[name] = min(st.agreed[name], len(st.seq))

    def extend(self, rid: str, ids: list[int]) -> None:
        st = self.request(rid)
        st.seq = st.seq + list(ids)
        st.last = []

    def adopt(self, rid: str, tokens: list[int]) -> None:
        """The step verifies ``tokens``, drafted elsewhere (:mod:`cluster.core.draft.near_far`): commits count over it."""
        st = self.request(rid)
        st.last, st.pre = list(tokens), None

    def release(self, rid: str) -> None:
        """Forget the request on every drafter it used; a deterministic one is first brought to the committed
        sequence (one rollback + extend, no forward), so a drafter that keeps what requests committed (the suffix
        drafter's index) keeps the output, not its own last proposals."""
        st = self._reqs.pop(rid, None)
        if st is not None:
            for name in st.held:
                if self.members[name].deterministic:
                    self._syncer(st, rid)(name, [])
                self.members[name].release(rid)

    def active_requests(self) -> list[str]:
        return list(self._reqs)

    def cache_info(self) -> dict:
        return {"members": {name: m.cache_info() for name, m in self.members.items()}}

    def probe(self) -> bool:
        """After a drafter went away: True once every drafter answers again (those that can tell)."""
        return all(h.probe() for h in self.members.values())

    # -- drafting -----------------------------------------------------------------------------------
    def draft_batch(self, items: list[tuple[str, DraftSpec, int, int]], stop=None, race=None) -> list:
        """One block per item ``(rid, spec, limit, budget)``: at most ``limit`` tokens; ``budget`` = tokens
        the request may still emit this step (bounds what :meth:`predraft` drafts ahead).  A request whose
        drafting failed gets its exception in place of a block (``stop``: see :meth:`_run`; a speculator's
        drafting gives up that way; ``race``: :class:`cluster.core.draft.race.Race`)."""
        out: list[DraftBlock | None] = [None] * len(items)
        todo = []
        for i, (rid, spec, limit, budget) in enumerate(items):
            st = self.request(rid)
            pre, st.pre = st.pre, None
            st.tries += pre is not None
            if pre is not None and pre.spec == spec and pre.expect == st.seq and len(pre.block.tokens) > 1:
                self.hits += 1
                st.hits += 1
                out[i] = pre.block.tail(1, limit)        # the drafters already hold it
            else:
                self.misses += pre is not None
                todo.append(_Run(i, rid, spec, [], limit))
        for run, block in zip(todo, self._run(todo, stop, race)):
            out[run.key] = block
        ok = [(item, b) for item, b in zip(items, out) if isinstance(b, DraftBlock)]
        for (rid, *_), block in ok:
            self.request(rid).last = list(block.tokens)
        if self.overlap:
            self._todo = [(DraftItem(*item), b) for item, b in ok]
            if not self.deferred:
                self.predraft()
        return out

    def predraft(self, stop=None) -> None:
        """Draft the next block of every request of the last call (see the module docstring).  ``stop`` (asked
        between drafting rounds, from this thread): give up, keeping no block (the host sets it once the next
        call shows that no block being drafted can be used, :meth:`could_use`)."""
        todo, self._todo = self._todo, []
        runs = []
        for (rid, spec, limit, budget), block in (todo if len(todo) <= self.MAX_ROWS else []):
            st = self._reqs.get(rid)
            nxt = min(limit, budget - len(block.tokens) - 2)   # the next step's limit if all is accepted
            if st is None or not block.tokens or nxt < 1 or st.last != block.tokens or \
                    not (self.sampled or st.sampling.greedy) or not st.worth_predrafting(self.MIN_HIT, self.PROBE_EVERY):
                continue
            runs.append(_Run(len(runs), rid, spec, list(block.tokens), nxt + 1))
        self._drafting = {run.rid: self._reqs[run.rid].seq + run.work for run in runs}
        try:
            blocks = self._run(runs, stop)
        finally:
            self._drafting = {}
        for run, pre in zip(runs, blocks):
            st = self._reqs[run.rid]
            if isinstance(pre, DraftBlock) and pre.tokens:
                st.pre = _Pre(st.seq + run.work + pre.tokens[:1], run.spec, pre)

    def could_use(self, ops) -> bool:
        """Whether a pre-draft now running could be used once ``ops`` (the next call's ``(op, rid, args)``
        bookkeeping: rollback / extend / release) are applied: some request's committed sequence would become the
        pre-draft's prefix + one token (the whole block accepted, the bonus to be compared).  Read from another
        thread while :meth:`predraft` runs; nothing is changed (the committed sequences only change in the call)."""
        seqs = {rid: (list(self._reqs[rid].seq), list(self._reqs[rid].last)) for rid in self._drafting}
        for op, rid, args in ops:
            if rid not in seqs:
                continue
            seq, last = seqs[rid]
            if op == "release":
                del seqs[rid]
            elif op == "rollback":
                seqs[rid] = ((seq + last)[:args[0]] if args[0] > len(seq) else seq[:args[0]], [])
            elif op == "extend":
                seqs[rid] = (seq + list(args[0]), [])
        return any(len(seq) == len(base) + 1 and seq[:len(base)] == base
                   for rid, base in self._drafting.items() if rid in seqs for seq in [seqs[rid][0]])

    pending = property(lambda self: bool(self._todo), doc="Whether :meth:`predraft` has work (run after answering).")

    # -- internals ----------------------------------------------------------------------------------
    def request(self, rid: str) -> _Req:
        """The request's state (committed ``seq``, ``sampling``, ``seed``), else UnknownRequestError."""
        try:
            return self._reqs[rid]
        except KeyError:
            raise UnknownRequestError(DRAFTS, rid) from None

    def _block_rng(self, seed: int, start: int) -> Rng:
        """A block's own draws (a cascade's internal reviews) from (seed, where the block starts): a function of the
        position, not of what was drawn before, so a pre-drafted block, a synchronous one and a resumed request's
        draw the same."""
        return self.rng_factory(derive_seed(seed, DRAFTS, str(start)))

    def _run(self, runs: list[_Run], stop=None, race=None) -> list:
        """Run the programs of ``runs`` together (``stop``: :func:`cluster.core.calls.drive`; ``race``: its
        ``withdraw``, with the tokens drafted so far); in order, a block or the exception that failed that request
        (a drafter's or a program's error fails only the requests it touched; one gone takes the side down)."""
        failed = self._prefill_members(runs)
        gens, rids, dcs = {}, {}, {}
        for run in runs:
            if run.key not in failed:
                st = self._reqs[run.rid]
                rng = partial(self._block_rng, st.seed, len(run.work))
                dcs[run.key] = dc = DraftCtx(run.rid, self.members, st.sampling, rng, self._syncer(st, run.rid),
                                             self._holder(st), committed=st.seq, alts=self.alts)
                gens[run.key] = run_program(run.spec, dc, run.work, run.limit, stoppable=bool(stop or race))
                rids[run.key] = run.rid
        withdraw = None if race is None else (lambda keys: race({k: dcs[k].partial for k in keys}))
        done = {**failed, **drive(gens, self.members, rids.__getitem__, group_failed=_gone, stop=stop,
                                  withdraw=withdraw)}
        return [done[run.key] for run in runs]

    def _prefill_members(self, runs) -> dict:
        """Prefill, batched per drafter, the drafters a run needs and its request has not used yet; returns
        {key: exception} for the runs whose prefill failed."""
        need: dict[str, list] = {}
        for run in runs:
            st = self._reqs[run.rid]
            for name in run.spec.drafters:
                if name not in st.held:
                    need.setdefault(name, []).append((run.key, PrefillItem(run.rid, list(st.seq), st.sampling,
                                                                           st.seed, st.salt)))
        failed = {}
        for name, items in need.items():
            try:
                self.members[name].prefill_batch([item for _, item in items])
            except ModelUnavailableError:
                raise
            except Exception as e:                       # noqa: BLE001 - fails these requests only
                failed.update({key: e for key, _ in items})
                continue
            for _, (rid, seq, *_) in items:
                st = self._reqs[rid]
                st.held[name], st.agreed[name] = list(seq), len(seq)
        return failed

    def _syncer(self, st: _Req, rid: str):
        def sync(name: str, work: list[int]) -> None:
            want, held = st.seq + work, st.held[name]
            c, n = st.agreed[name], min(len(held), len(st.seq) + len(work))
            while c < n and held[c] == want[c]:
                c += 1
            h = self.members[name]
            if c < len(held):
                h.rollback(rid, c)
            if c < len(want):
                h.extend(rid, want[c:])
            st.held[name], st.agreed[name] = want, len(st.seq)
        return sync

    @staticmethod
    def _holder(st: _Req):
        def held(name: str, work: list[int]) -> None:
            st.held[name], st.agreed[name] = st.seq + work, len(st.seq)
        return held
