"""Near drafter, far speculator: the draft side of the ``speculator`` topology.

The engine sees one handle, :data:`cluster.core.draft.programs.DRAFTS`, as with any draft side.  Behind it:

* the **near** draft side (:class:`cluster.core.draft.side.DraftSide` over drafters in the coordinator's own
  process: the colocated draft side), which answers every miss with no round trip;
* a **far speculator** (:class:`cluster.core.draft.speculator.Speculator`, in a process of its own, reached
  through a :class:`SpeculatorLink`) that, while the target verifies each block, drafts the next block for the
  likely outcomes of that verification and sends them back to fill the speculation cache
  (:mod:`cluster.core.draft.cache`; Kumar et al., *Speculative Speculative Decoding*; Liu et al., *PEARL*).

Each ``draft_batch``: read the speculator's answers that have arrived (never waiting: one not arrived counts as
``late``); per request take the block drafted from exactly the committed sequence (a hit), else draft near (first
sending the committed sequences, :meth:`NearFarSide._outcome`), racing the answer (:mod:`cluster.core.draft.race`:
taken the moment it lands, where exact); then send the speculator the blocks about to be verified (nothing awaited).
A late or dead speculator leaves colocated speed.  Lossless: every block, near or far, is a draw of the draft
program at the exact committed sequence it is verified against, with the distribution it was drawn from, made
independently of the target's draws (:mod:`cluster.core.draft.cache`).  Only greedy requests are speculated unless
``sampled=True`` (as pre-drafting: a seed then gives the same tokens in every runtime); only for steps of at most
``max_rows`` requests (beyond, the spare core is not spare: see :attr:`NearFarSide.MAX_ROWS`).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod

from cluster.core.draft.cache import KNOWN, Entry, FanOut, SpeculationCache
from cluster.core.draft.programs import DRAFTS, DraftBlock
from cluster.core.draft.race import Race
from cluster.core.draft.side import DraftSide
from cluster.core.draft.speculator import Fill, FillItem, Reply, Speculator
from cluster.core.interfaces import BatchedHandle, UnsupportedCallError


class SpeculatorLink(ABC):
    """How the near side reaches its speculator: ``send`` never waits for the answer; ``poll`` returns the
    answers that have arrived, without waiting; ``up`` is False while the speculator is gone."""

    up: bool = True

    @abstractmethod
    def send(self, fill: Fill) -> bool:
        """Send ``fill``; False when it could not be (the link is down, or the fill does not travel)."""

    @abstractmethod
    def poll(self) -> list[Reply]: ...

    def close(self) -> None:
        """Stop what the link started; nothing by default."""


class LocalLink(SpeculatorLink):
    """A speculator in this process (tests, ``--runtime in-process``): each fill is drafted when sent, and its
    answer arrives ``delay`` polls later (0: at the next step; more: a speculator that is late); ``ahead``: then
    drafts the next fill ahead on its likeliest outcome, as the actor's host does while idle."""

    def __init__(self, speculator: Speculator, delay: int = 0, ahead: bool = False):
        self.speculator, self.delay, self.ahead = speculator, delay, ahead
        self._queue: list[list] = []                   # [polls to wait, reply]

    def send(self, fill: Fill) -> bool:
        self._queue.append([self.delay, self.speculator.fill(fill)])
        if self.ahead:
            self.speculator.ahead()
        return True

    def poll(self) -> list[Reply]:
        ready = [r for wait, r in self._queue if wait <= 0]
        self._queue = [[wait - 1, r] for wait, r in self._queue if wait > 0]
        return ready


class NearFarSide(BatchedHandle):
    """See the module docstring.  ``near``: the coordinator's draft side (overlap off); ``link``: the speculator."""

    name = DRAFTS
    MAX_ROWS = 1    # fills for one-row steps only: for more rows they take the cores verification and the front use

    def __init__(self, near: DraftSide, link: SpeculatorLink, *, fanout: FanOut | None = None,
                 sampled: bool = False, max_rows: int = MAX_ROWS):
        self.near, self.link, self.sampled, self.max_rows = near, link, sampled, max_rows
        self.fanout = fanout or FanOut()
        self.cache = SpeculationCache()
        self.vocab_size, self.max_length, self.num_params = near.vocab_size, near.max_length, near.num_params
        self.members = near.members
        near.alts = max(near.alts, self.fanout.width)  # its blocks carry the rejection bets
        self._sent, self._sent_at = 0, 0.0             # the last fill's id (0: none) and when it left
        self._waiting: list[str] = []                  # the requests of a fill whose answer has not arrived
        self._released: list[str] = []
        self._asked: set[str] = set()                  # the requests of the fill sent the step before (if any)
        self._judged = True                            # whether the last fill's answer tells the fan-out anything

    @property
    def counters(self):
        return self.cache.counters

    # -- the handle protocol: bookkeeping goes to the near side ----------------------------------------
    def prefill_batch(self, items) -> None:
        for rid, *_ in items:
            self.cache.drop(rid)
        self.near.prefill_batch(items)

    def score_batch(self, items) -> list:
        raise UnsupportedCallError(self.name, "score_batch")

    def rollback(self, rid: str, length: int) -> None:
        self.near.rollback(rid, length)

    def extend(self, rid: str, ids: list[int]) -> None:
        self.near.extend(rid, ids)

    def release(self, rid: str) -> None:
        self.near.release(rid)
        self.cache.drop(rid)
        self._released.append(rid)
        if rid in self._waiting:                      # its answer can no longer be used (nor be late)
            self._waiting.remove(rid)

    def flush(self) -> None:
        """Tell the speculator of ended requests now (a fill of releases only, id 0: its answer is ignored)."""
        released, self._released = self._released, []
        if released and self.link.up:             # (a speculator that is down lost its state with it)
            self.link.send(Fill(0, [], [], released))

    def active_requests(self) -> list[str]:
        return self.near.active_requests()

    def cache_info(self) -> dict:
        return self.near.cache_info()

    def probe(self) -> bool:
        return self.near.probe()

    # -- drafting -------------------------------------------------------------------------------------
    def draft_batch(self, items: list[tuple], stop=None) -> list:
        """One block per item ``(rid, spec, limit, budget)`` (see the module docstring)."""
        t0 = time.perf_counter()
        self._receive()
        out: list = [None] * len(items)
        miss = []
        c = self.cache.counters
        taken = [self.take(rid, spec) for rid, spec, _, _ in items]
        if None in taken:       # near drafts this step anyway, one batched forward per round for all its rows: a
            for i, used in enumerate(taken):     # row whose cached block is shorter than asked is drafted there too
                if used is not None and len(used.block.tokens) < items[i][2]:
                    taken[i] = None
                    c.short, c.wasted = c.short + 1, c.wasted + len(used.block.tokens)
        for i, ((rid, spec, limit, _), used) in enumerate(zip(items, taken)):
            c.steps += 1
            if used is not None:
                c.hits[used.key[0]] += 1
                out[i] = used.block.tail(0, limit)
                self.near.adopt(rid, out[i].tokens)
            else:
                miss.append(i)
        if miss:
            self._outcome([items[i] for i in miss])
            race = Race(self, [items[i] for i in miss]) if self._waiting else None
            blocks = self.near.draft_batch([items[i] for i in miss], race=race)
            for i, block in zip(miss, race.settle(blocks) if race else blocks):
                out[i] = block
        self._waiting = []                           # (an answer that comes later is for an older fill)
        self._send(items, out)
        dt = time.perf_counter() - t0
        c.calls, c.call_s = c.calls + 1, c.call_s + dt
        if not miss:
            c.hit_calls, c.hit_s = c.hit_calls + 1, c.hit_s + dt
        return out

    def take(self, rid: str, spec) -> Entry | None:
        """The cached block for ``rid``'s committed sequence and ``spec`` (else None); every other entry of the
        request is wasted, and the fan-out learns which of its bets came true."""
        used, entries = self.cache.take(rid, self.near.request(rid).seq, spec)
        if entries:
            self.fanout.outcome([e.key for e in entries], used.key if used else None)
            self.cache.counters.wasted += sum(len(e.block.tokens) for e in entries if e is not used)
        return used

    def poll(self) -> bool:
        """Read the answers that have arrived (never waiting) into the cache; True once the last fill's is in."""
        for reply in self.link.poll():               # (a link that is down reconnects from here)
            if reply.id and reply.id == self._sent and self._waiting:
                self.cache.counters.fill_s += reply.compute_s
                live = set(self.near.active_requests())
                for rid, entries in reply.entries.items():
                    if rid in live:
                        self.cache.put(rid, entries)
                self.cache.counters.rows += reply.rows
                self.cache.counters.ahead += reply.ahead
                self.cache.counters.fills += 1
                self._waiting = []
            elif reply.id:                             # a late answer to an older fill: all of it wasted
                self.cache.counters.wasted += reply.tokens
        return not self._waiting

    def _receive(self) -> None:
        """At the step's start: the answer to the last fill, if it has arrived; counted late otherwise, for the
        fan-out too (which sizes fills to come within one verification), though the miss drafting races it
        (:mod:`cluster.core.draft.race`)."""
        if not self._waiting:
            self.poll()
            return
        self.cache.counters.gap_s += time.perf_counter() - self._sent_at
        in_time = self.poll()
        if self._judged:
            self.fanout.answered(in_time)
        if self._waiting:
            self.cache.counters.late += len(self._waiting)
            self.cache.counters.late_fills += 1

    def _send(self, items: list[tuple], out: list) -> None:
        asked, self._asked = self._asked, set()
        if not self.link.up:                           # (a speculator that is down lost its state with it)
            self._released = []
            return
        fill_items = []
        for (rid, spec, limit, budget), block in zip(items, out if len(items) <= self.max_rows else []):
            st = self.near.request(rid)
            if isinstance(block, DraftBlock) and block.tokens and self._speculated(st) and self._worth(spec):
                fill_items.append(FillItem(rid, list(st.seq), st.sampling, st.seed, spec, list(block.tokens),
                                           limit, budget, block.alts, salt=st.salt))
        if not (fill_items or self._released) or not self.fanout.ask():
            return
        length = max((len(it.block) for it in fill_items), default=0)
        f = self.fanout
        f.max_depth = max(f.min_depth, max((it.limit for it in fill_items), default=f.max_depth))
        # judged only where the speculator drafted every request's last step: one that first catches it up (a prefill,
        # steps not asked about) comes late whatever its fan-out; judging it kept the side backed off for good
        self._fill(fill_items, f.keys(length), f.fill_depth, all(it.rid in asked for it in fill_items))

    def _outcome(self, items: list[tuple]) -> None:
        """A miss step with no answer awaited (bets wrong, or a first draft) sends its committed sequences before near
        drafts (``then`` items): the speculator drafts the same blocks alongside, then bets on their verification at
        once, not from the fill sent once near has drafted (which often came late after a rejection).  Greedy only (a sampled far block is another draw: never as predicted); not while backing off."""
        if self._waiting or len(items) > self.max_rows or not self.link.up or self.fanout.backing_off:
            return
        then = [FillItem(rid, list(st.seq), st.sampling, st.seed, spec, [], limit, budget, then=True, salt=st.salt)
                for rid, spec, limit, budget in items for st in [self.near.request(rid)]
                if st.sampling.greedy and self._speculated(st) and self._worth(spec)]
        if then:
            asked = self._asked             # (judging the next fill is as without it)
            self._fill(then, [KNOWN], self.fanout.fill_depth, judged=False)
            self._asked = asked

    def _worth(self, spec) -> bool:
        """Whether ``spec``'s blocks are worth drafting far (measured served: ``specserve bench --suite served``): not for the Max-Gram
        drafter alone -- it drafts a block in a fraction of a millisecond, less than a fill costs the coordinator
        (building and sending it, reading the answer) -- nor for a cascade (CS Drafting), whose fill takes longer
        than a verification, so its blocks came late or cut to the fan-out's depth, shorter than near drafts them."""
        return spec.kind != "cascade" and not all(getattr(self.members.get(n), "deterministic", False)
                                                  for n in spec.drafters)

    def _speculated(self, st) -> bool:
        """Whether a request's blocks are drafted far: greedy ones (any, with ``sampled``), without a grammar
        (its state stays here)."""
        return (self.sampled or st.sampling.greedy) and getattr(st.sampling, "constraint", None) is None

    def _fill(self, items: list[FillItem], keys: list, depth: int, judged: bool = True) -> None:
        self._sent += 1
        fill = Fill(self._sent, items, keys, self._released, depth)
        self._released = []
        if self.link.send(fill):
            self._waiting = [it.rid for it in items]
            self._sent_at, self._judged, self._asked = time.perf_counter(), judged, set(self._waiting)
