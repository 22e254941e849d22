"""Near drafter, far speculator (cluster.core.draft.{cache,speculator,near_far}): literal branches and fan-out,
exact output laws with the speculation cache, alone and batched, and greedy outputs equal to plain decoding."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.core.draft.cache import KNOWN, Branch, Entry, FanOut, SpeculationCache, candidates
from cluster.core.draft.near_far import LocalLink, NearFarSide
from cluster.core.draft.programs import DRAFTS, DraftBlock, DraftSpec
from cluster.core.draft.side import DraftSide
from cluster.core.draft.speculator import Fill, FillItem, Speculator
from cluster.core.sampling import Rng, SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.strategies import resolve_options
from tests.support.exact import (
    TabularModel,
    VocabTokenizer,
    enumerate_outcomes,
    greedy_vs_plain,
    local_engine,
    max_abs_diff,
    mixed_batch,
    steps_law,
    target_joint,
)

BATCH = 8          # the tests batch up to this many rows through the cache (NearFarSide's max_rows; served: MAX_ROWS)


def near_far(drafters: dict, copies: dict, *, rng=None, delay: int = 0, rows: int = 4, sampled: bool = True,
             ahead: bool = False):
    """A near-far draft side over ``drafters`` (near) and ``copies`` (the speculator's own drafters); ``ahead``: the
    speculator drafts each next fill ahead (:meth:`Speculator.ahead`)."""
    kw = {} if rng is None else dict(rng_factory=lambda s: rng)
    spec = Speculator(copies, **kw)
    return NearFarSide(DraftSide(drafters, **kw), LocalLink(spec, delay, ahead), fanout=FanOut(rows=rows),
                       sampled=sampled, max_rows=BATCH)


# -- literal branches ------------------------------------------------------------------------------
def test_candidates_bet_on_the_drafters_next_best_tokens_and_its_own_bonus():
    block, alts = [1, 2], [[2, 3], [0, 4]]              # the drafter's next-best tokens per position, best first
    keys = [("bonus", -1, 0), ("reject", 0, 0), ("reject", 1, 0), ("bonus", -1, 1), ("reject", 1, 1),
            ("reject", 2, 0), ("reject", 0, 2)]          # no bonus of rank 1; past the block; beyond the alts
    got = candidates(block, alts, keys)
    assert got == [Branch("bonus", 2, 0, None), Branch("reject", 0, 0, 2), Branch("reject", 1, 0, 0),
                   Branch("reject", 1, 1, 4)]
    assert got[0].start([7], block) == [7, 1, 2] and got[2].start([7], block) == [7, 1, 0]
    assert got[0].key == ("bonus", -1, 0) and got[2].key == ("reject", 1, 0)
    assert candidates(block, None, keys) == got[:1]      # no alternatives recorded (Max-Gram): the bonus only


def test_blocks_record_the_drafters_next_best_tokens():
    d = TabularModel("d", 5, seed=3)
    side = DraftSide({"d": d}, alts=2)
    side.prefill_batch([("r", [0, 1], SamplingParams(0.0), 0)])
    (block,) = side.draft_batch([("r", DraftSpec("propose", ("d",)), 3, 10)])
    seq = [0, 1]
    for tok, alt in zip(block.tokens, block.alts):
        order = d.logits(seq).argsort(descending=True).tolist()
        assert tok == order[0] and alt == order[1:3]
        seq.append(tok)
    assert block.tail(1, 1).alts == block.alts[1:2]


def test_fanout_ranks_by_hit_rate_and_follows_the_spare_core():
    f = FanOut(rows=3, depth=4, max_rows=4, max_depth=4, width=1)
    assert f.keys(2) == [("bonus", -1, 0), ("reject", 1, 0), ("reject", 0, 0)]     # ties: bonus, later positions
    for _ in range(5):
        f.outcome([("bonus", -1, 0), ("reject", 1, 0), ("reject", 0, 0)], ("reject", 0, 0))
    assert f.keys(2)[0] == ("reject", 0, 0)
    f.answered(False)                                    # late: fewer rows first (down to 2) ...
    assert (f.rows, f.depth) == (2, 4) and len(f.keys(2)) == 2
    f.answered(False)                                    # ... then shallower blocks
    assert (f.rows, f.depth) == (2, 3)
    for _ in range(FanOut.RAISE_AFTER):                  # in time: deeper first, then more rows
        f.answered(True)
    assert (f.rows, f.depth) == (2, 4)
    for _ in range(FanOut.RAISE_AFTER):
        f.answered(True)
    assert (f.rows, f.depth) == (3, 4)
    f.rows, f.depth = 2, f.min_depth
    f.answered(False)
    assert (f.rows, f.depth) == (1, f.min_depth)


def test_the_cache_gives_a_block_only_for_its_exact_prefix_and_spec():
    spec, other = DraftSpec("propose", ("d",)), DraftSpec("propose", ("e",))
    cache = SpeculationCache()
    e1, e2 = Entry([1, 2, 3], spec, DraftBlock([4, 5]), ("bonus", -1, 0)), Entry([1, 4], spec, DraftBlock([6]),
                                                                                 ("reject", 1, 0))
    cache.put("r", [e1, e2])
    assert cache.take("r", [1, 2], spec) == (None, [e1, e2])             # no entry for this prefix; all gone
    assert cache.take("r", [1, 4], spec) == (None, [])
    cache.put("r", [e1, e2])
    assert cache.take("r", [1, 4], other)[0] is None
    cache.put("r", [e1, e2])
    assert cache.take("r", [1, 4], spec)[0] is e2


def test_the_speculator_drafts_each_branch_from_its_own_prefix():
    d = TabularModel("d", 5, seed=3)
    spec_ = Speculator({"d": TabularModel("d", 5, seed=3)})
    spec = DraftSpec("propose", ("d",))
    greedy = SamplingParams(0.0)

    def argmax_path(seq, n):
        out = []
        for _ in range(n):
            out.append(int(d.logits(seq + out).argmax()))
        return out
    reply = spec_.fill(Fill(1, [FillItem("r", [0, 1], greedy, 0, spec, [2, 3], 2, 10, [[4], [0]])],
                            [("bonus", -1, 0), ("reject", 0, 0), ("reject", 1, 0)], depth=2))
    entries = reply.entries["r"]
    assert reply.rows == 3 and [e.key for e in entries] == [("bonus", -1, 0), ("reject", 0, 0), ("reject", 1, 0)]
    bonus = argmax_path([0, 1, 2, 3], 3)                 # its bet is the drafter's own next token after the block
    assert entries[0].expect == [0, 1, 2, 3, bonus[0]] and entries[0].block.tokens == bonus[1:]
    assert entries[1].expect == [0, 1, 4] and entries[2].expect == [0, 1, 2, 0]
    for e in entries:                                    # greedy: the drafter's own argmax path from the branch
        assert e.block.tokens == argmax_path(list(e.expect), 2) and len(e.block.alts) == 2
    # the next fill moves the same branches (rollback + extend, no new prefill), and release frees them
    spec_.fill(Fill(2, [FillItem("r", [0, 1, 2, 3, 4], greedy, 0, spec, [1], 2, 8)], [("bonus", -1, 0)]))
    spec_.release("r")
    assert not spec_.side.active_requests() and not spec_.side.members["d"].seqs


def test_a_fill_drafted_ahead_answers_as_a_fresh_one_and_only_when_it_came_as_predicted():
    """After a fill the speculator drafts the next one on the likeliest outcome (the block accepted and the bonus
    bet right, the coordinator verifying the block drafted for it): a fill that comes as predicted is answered with
    exactly the blocks a fresh speculator drafts for it, without drafting; any other fill is drafted as usual."""
    spec = DraftSpec("propose", ("d",))
    greedy = SamplingParams(0.0)
    keys = [("bonus", -1, 0), ("reject", 0, 0)]
    first = Fill(1, [FillItem("r", [0, 1], greedy, 0, spec, [2, 3], 2, 10, [[4], [0]])], keys, depth=2)
    spec_ = Speculator({"d": TabularModel("d", 5, seed=3)}, alts=1)
    bonus = next(e for e in spec_.fill(first).entries["r"] if e.key[0] == "bonus")
    assert spec_.ahead() == 1
    nxt = Fill(2, [FillItem("r", bonus.expect, greedy, 0, spec, bonus.block.tokens, 2, 7, bonus.block.alts)],
               keys, depth=2)
    assert spec_.predicted(nxt)
    fresh = Speculator({"d": TabularModel("d", 5, seed=3)}, alts=1).fill(nxt)
    drafted = []
    draft_batch = spec_.side.draft_batch
    spec_.side.draft_batch = lambda runs, stop=None: drafted.append(runs) or draft_batch(runs, stop=stop)
    got = spec_.fill(nxt)
    assert got.ahead == 1 and not drafted and (got.rows, got.tokens) == (fresh.rows, fresh.tokens) == (2, 4)
    assert [(e.expect, e.block.tokens, e.key) for e in got.entries["r"]] == \
        [(e.expect, e.block.tokens, e.key) for e in fresh.entries["r"]]
    # the outcome was a rejection instead: not as predicted, drafted now
    spec_.ahead()
    other = Fill(3, [FillItem("r", bonus.expect[:-1] + [0], greedy, 0, spec, [1, 2], 2, 7, [[3], [4]])], keys, depth=2)
    assert not spec_.predicted(other)
    got = spec_.fill(other)
    assert got.ahead == 0 and got.rows == 2 and drafted
    # a request released since is never answered from the look-ahead; another fan-out (the fill's branches and
    # depth moved with a late answer) is, with the blocks drafted for the last one's
    spec_.ahead()
    assert not spec_.predicted(Fill(4, other.items, keys, released=["r"], depth=2))
    ahead = next(e for e in got.entries["r"] if e.key[0] == "bonus")
    moved = Fill(4, [FillItem("r", ahead.expect, greedy, 0, spec, ahead.block.tokens, 2, 4, ahead.block.alts)],
                 keys[:1], depth=1)
    assert spec_.predicted(moved)
    fresh = Speculator({"d": TabularModel("d", 5, seed=3)}, alts=1).fill(replace(moved, keys=keys, depth=2))
    got = spec_.fill(moved)
    assert got.ahead == 1 and [(e.expect, e.block.tokens, e.key) for e in got.entries["r"]] == \
        [(e.expect, e.block.tokens, e.key) for e in fresh.entries["r"]]


def test_a_committed_sequence_sent_before_near_drafts_is_drafted_and_looked_ahead_on():
    """A ``then`` item (a miss step's committed sequence, sent before near drafts): the speculator drafts the block
    near drafts (the same greedy drafter), then looks ahead on the fill that verifies it, with the last fill's bets;
    that fill, as predicted, is answered with exactly a fresh speculator's blocks, without drafting."""
    spec, greedy = DraftSpec("propose", ("d",)), SamplingParams(0.0)
    keys = [("bonus", -1, 0), ("reject", 0, 0)]
    spec_ = Speculator({"d": TabularModel("d", 5, seed=3)}, alts=1)
    spec_.fill(Fill(1, [FillItem("r", [0, 1], greedy, 0, spec, [2, 3], 2, 10, [[4], [0]])], keys, depth=2))
    then = FillItem("r", [0, 1, 4], greedy, 0, spec, [], 2, 9, then=True)
    [known] = spec_.fill(Fill(2, [then], [KNOWN], depth=2)).entries["r"]
    near = DraftSide({"d": TabularModel("d", 5, seed=3)}, alts=1)
    near.prefill_batch([("r", [0, 1, 4], greedy, 0)])
    [block] = near.draft_batch([("r", spec, 2, 9)])
    assert (known.expect, known.key, known.block.tokens, known.block.alts) == ([0, 1, 4], KNOWN, block.tokens,
                                                                               block.alts)
    assert spec_.ahead() == 1
    nxt = Fill(3, [FillItem("r", [0, 1, 4], greedy, 0, spec, block.tokens, 2, 9, block.alts)], keys, depth=2)
    assert spec_.predicted(nxt)
    fresh = Speculator({"d": TabularModel("d", 5, seed=3)}, alts=1).fill(nxt)
    got = spec_.fill(nxt)
    assert got.ahead == 1 and got.rows == fresh.rows == 2
    assert [(e.expect, e.block.tokens, e.key) for e in got.entries["r"]] == \
        [(e.expect, e.block.tokens, e.key) for e in fresh.entries["r"]]


def _recorded(side) -> list:
    """The fills ``side`` sends from now on, in order (each still sent)."""
    sent, send = [], side.link.send
    side.link.send = lambda fill: sent.append(fill) or send(fill)
    return sent


def test_a_miss_step_sends_its_committed_sequence_first_for_greedy_requests_only():
    """A greedy miss (no answer awaited) sends a ``then`` fill before near drafts, then the bets on its block; a
    sampled one or an awaited answer sends only the bets; a side backing off sends neither."""
    spec = DraftSpec("propose", ("d",))
    for sampling, waiting, off, want in [(SamplingParams(0.0), False, False, [True, False]),
                                         (SamplingParams(1.0), False, False, [False]),
                                         (SamplingParams(0.0), True, False, [False]),
                                         (SamplingParams(0.0), False, True, [])]:
        side = near_far({"d": TabularModel("d", 5, seed=3, rng=Rng(1))}, {"d": TabularModel("d", 5, seed=3)},
                        delay=5, rng=Rng(1))
        sent = _recorded(side)
        side.prefill_batch([("r", [0, 1], sampling, 0)])
        side._waiting = ["r"] if waiting else []
        if off:
            side.fanout = FanOut(rows=1, depth=2, on_time=0.0)
        side.draft_batch([("r", spec, 2, 10)])
        assert [all(it.then for it in f.items) for f in sent if f.items] == want
        if want and want[0]:
            assert sent[0].items[0].seq == [0, 1] and sent[0].keys == [KNOWN]


def test_as_shipped_only_one_row_steps_are_speculated():
    """``NearFarSide.MAX_ROWS`` (served: with more rows the fills cost more than they saved): a step of one greedy row
    sends fills, a step of two sends none and is drafted near, its outputs as before."""
    spec, greedy = DraftSpec("propose", ("d",)), SamplingParams(0.0)
    for rows, fills in [(1, True), (2, False)]:
        side = NearFarSide(DraftSide({"d": TabularModel("d", 5, seed=3)}),
                           LocalLink(Speculator({"d": TabularModel("d", 5, seed=3)})))
        sent = _recorded(side)
        rids = [f"r{i}" for i in range(rows)]
        side.prefill_batch([(rid, [0, 1], greedy, 0) for rid in rids])
        blocks = side.draft_batch([(rid, spec, 2, 10) for rid in rids])
        assert all(len(b.tokens) == 2 for b in blocks)
        assert bool([f for f in sent if f.items]) == fills and side.max_rows == NearFarSide.MAX_ROWS == 1


def test_a_look_ahead_given_up_keeps_nothing():
    """A look-ahead stopped between drafting rounds keeps no block: the fill it predicted is drafted in full."""
    spec = DraftSpec("propose", ("d",))
    spec_ = Speculator({"d": TabularModel("d", 5, seed=3)})
    item = FillItem("r", [0, 1], SamplingParams(0.0), 0, spec, [2, 3], 3, 20)
    bonus = spec_.fill(Fill(1, [item], [("bonus", -1, 0)], depth=3)).entries["r"][0]
    asked = []
    assert spec_.ahead(stop=lambda: asked.append(1) or len(asked) > 1) == 0 and asked
    nxt = Fill(2, [FillItem("r", bonus.expect, item.sampling, 0, spec, bonus.block.tokens, 3, 17,
                                bonus.block.alts)],
               [("bonus", -1, 0)], depth=3)
    assert spec_.predicted(nxt)                    # what it was drafting, though it kept nothing
    got = spec_.fill(nxt)
    assert got.ahead == 0 and got.rows == 1 and len(got.entries["r"][0].block.tokens) == 3


# -- exact laws ------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts,sampling,delay", [
    (dict(drafter="d", k=1), SamplingParams(1.0, top_k=2), 0),
    pytest.param(dict(drafter="d", k=2, verify="block"), SamplingParams(0.8, top_k=2), 0,   # ~30 s: the slow
                 marks=pytest.mark.slow),                                                    # suite's
    pytest.param(dict(drafter="d", k=1), SamplingParams(1.0), 2,           # every answer late: near only;
                 marks=pytest.mark.slow),                                  # ~2 min: the slow suite's
])
def test_the_speculation_cache_keeps_the_target_law_exactly(opts, sampling, delay):
    """Every draw enumerated, the speculator's branches (and its look-ahead's) included: whichever branch the
    target's outcome picks (or none), the first three tokens follow the target exactly."""
    target = TabularModel("target", 3, seed=5)
    d = TabularModel("d", 3, seed=6, zeros=True)

    sides = []

    def side(drafters, rng):
        copy = TabularModel("d", 3, seed=6, zeros=True, rng=rng)
        return near_far(drafters, {"d": copy}, rng=rng, delay=delay, rows=2)

    got = steps_law("speculative", resolve_options("speculative", opts, {}), {"target": target, "d": d}, "target",
                    [0, 1], sampling, 3, 4, side=side)
    assert max_abs_diff(got, target_joint(target, [0, 1], 3, sampling)) < 1e-9


@pytest.mark.slow      # ~70 s (7 tokens: fewer take no answer drafted ahead); the slow suite's
def test_blocks_drafted_ahead_keep_the_target_law_exactly():
    """A sampled request through the engine with a speculator that drafts each next fill ahead (its look-ahead's
    draws enumerated too): the tokens follow the target exactly, and answers drafted ahead were taken."""
    target, d = TabularModel("target", 2, seed=31), TabularModel("d", 2, seed=32)
    copy = TabularModel("d", 2, seed=32)
    sampling = SamplingParams(1.0)
    sides = []

    def run(rng):
        d.rng = copy.rng = rng
        sides.append(near_far({"d": d}, {"d": copy}, rng=rng, rows=1, ahead=True))
        engine = local_engine({"target": target, "d": d, DRAFTS: sides[-1]}, VocabTokenizer(2),
                              rng_factory=lambda s: rng)
        req = GenerationRequest(prompt_ids=[0], max_new_tokens=7, sampling=sampling, seed=1, strategy="speculative",
                                options={"drafter": "d", "k": 1}, request_id="r")
        return tuple(engine.generate_many([req])[0].token_ids)

    got = enumerate_outcomes(run)
    assert max_abs_diff(got, target_joint(target, [0], 7, sampling)) < 1e-9
    assert sum(s.counters.ahead for s in sides) > 0


def test_the_speculation_cache_batched_is_exact_per_request():
    """A sampled request decoded with a greedy one by the engine through the near-far side: the sampled one's law
    is the target's, the greedy one is the target's argmax path (its draws enumerated alongside)."""
    target, d = TabularModel("target", 3, seed=21), TabularModel("d", 3, seed=22, zeros=True)
    copy = TabularModel("d", 3, seed=22, zeros=True)
    sampling, greedy = SamplingParams(1.0), SamplingParams(0.0)
    want_greedy = target_joint(target, [2, 1], 3, greedy)
    sides = []

    def run(rng):                  # a fresh side per path: its fan-out learns, and a replay must draw the same
        d.rng = copy.rng = rng
        sides.append(near_far({"d": d}, {"d": copy}, rng=rng, rows=2))
        engine = local_engine({"target": target, "d": d, DRAFTS: sides[-1]}, VocabTokenizer(3),
                              rng_factory=lambda s: rng)
        return mixed_batch(engine, sampling, want_greedy)

    got = enumerate_outcomes(run)
    assert max_abs_diff(got, target_joint(target, [0], 3, sampling)) < 1e-9
    assert sum(sum(s.counters.hits.values()) for s in sides) > 0 and all(s.counters.fills for s in sides)
    side = sides[-1]
    assert not target.seqs and not d.seqs and not side.active_requests()


# -- greedy equality end to end --------------------------------------------------------------------
@pytest.mark.parametrize("seed_d,ahead", [(9, False), (40, False), (9, True), (40, True)])
def test_greedy_outputs_equal_plain_decoding_and_the_cache_is_used(seed_d, ahead):
    """A drafter equal to the target (seed 9: every bonus bet comes true) and one that is not (seed 40:
    rejections, some of them guessed), with and without fills drafted ahead: greedy outputs equal the target's,
    batched, and hits are counted by kind."""
    target, d = TabularModel("target", 5, seed=9), TabularModel("d", 5, seed=seed_d)
    side = near_far({"d": d}, {"d": TabularModel("d", 5, seed=seed_d)}, sampled=False, ahead=ahead)
    engine = local_engine({"target": target, "d": d, DRAFTS: side}, VocabTokenizer(5))
    plain = local_engine({"target": TabularModel("target", 5, seed=9)}, VocabTokenizer(5))
    reqs = [dict(prompt_ids=p, max_new_tokens=30, sampling=SamplingParams(0.0), seed=0, request_id=f"r{i}")
            for i, p in enumerate(([1, 2], [3], [4, 0, 1]))]
    got, want = greedy_vs_plain(engine, plain, reqs, {"drafter": "d", "k": 4})
    assert got == want
    c = side.counters
    assert c.steps > 0 and c.fills > 0 and c.rows >= c.fills
    if seed_d == 9:
        assert c.hits["bonus"] >= c.steps - 2 * len(reqs) and c.hits["reject"] == 0
        assert (c.ahead > 0) == ahead                  # every bet comes true: the look-ahead is used
    else:
        assert c.hits["reject"] + c.hits["bonus"] > 0 and c.wasted > 0
    assert not side.active_requests() and not side.link.speculator.active_requests()
    assert not d.seqs and not side.link.speculator.side.members["d"].seqs


def test_a_short_cached_block_is_drafted_near_when_near_drafts_anyway():
    """Two rows, one with a cached block shorter than asked and one without: near drafts this step anyway (one
    batched forward per round for both), so both get its full-length blocks; alone, the short block is taken."""
    spec, greedy = DraftSpec("propose", ("d",)), SamplingParams(0.0)
    side = near_far({"d": TabularModel("d", 5, seed=3)}, {"d": TabularModel("d", 5, seed=3)}, sampled=False)
    side.link.up = False                                 # nothing sent: the cache holds what the test puts there
    side.prefill_batch([("a", [0, 1], greedy, 0), ("b", [2], greedy, 0)])
    side.cache.put("a", [Entry([0, 1], spec, DraftBlock([4]), ("bonus", -1, 0))])
    a, b = side.draft_batch([("a", spec, 3, 10), ("b", spec, 3, 10)])
    assert len(a.tokens) == len(b.tokens) == 3 and side.counters.short == 1 and not side.counters.hits
    side.rollback("a", 2), side.rollback("b", 1)
    side.cache.put("a", [Entry([0, 1], spec, DraftBlock([4]), ("bonus", -1, 0))])
    [a] = side.draft_batch([("a", spec, 3, 10)])
    assert a.tokens == [4] and side.counters.hits["bonus"] == 1 and side.counters.short == 1


def test_blocks_of_the_max_gram_drafter_alone_or_a_cascade_are_not_drafted_far():
    """A spec whose drafters are all deterministic (the Max-Gram drafter: a block in a fraction of a millisecond)
    sends no fill: a hit would save less than the fill costs; nor does a cascade's.  Outputs unchanged."""
    target, d = TabularModel("target", 5, seed=9), TabularModel("d", 5, seed=9)
    d.deterministic = True
    side = near_far({"d": d}, {"d": TabularModel("d", 5, seed=9)}, sampled=False)
    engine = local_engine({"target": target, "d": d, DRAFTS: side}, VocabTokenizer(5))
    req = dict(prompt_ids=[1, 2], max_new_tokens=20, sampling=SamplingParams(0.0), seed=0)
    want = local_engine({"target": TabularModel("target", 5, seed=9)}, VocabTokenizer(5)).generate(
        GenerationRequest(strategy="autoregressive", **req)).token_ids
    got = engine.generate(GenerationRequest(strategy="speculative", options={"drafter": "d", "k": 4}, **req))
    assert got.token_ids == want and side.counters.steps > 0 and side.counters.fills == 0
    assert not side.link.speculator.active_requests()
    d.deterministic = False                              # a neural drafter's blocks are, a cascade's are not
    assert side._worth(DraftSpec("propose", ("d",))) and not side._worth(DraftSpec("cascade", ("d",)))


def test_a_dead_speculator_leaves_near_drafting():
    """The link goes down: every block is drafted near, outputs unchanged, nothing is sent."""
    target, d = TabularModel("target", 5, seed=9), TabularModel("d", 5, seed=9)
    side = near_far({"d": d}, {"d": TabularModel("d", 5, seed=9)}, sampled=False)
    side.link.up = False
    engine = local_engine({"target": target, "d": d, DRAFTS: side}, VocabTokenizer(5))
    req = dict(prompt_ids=[1, 2], max_new_tokens=20, sampling=SamplingParams(0.0), seed=0)
    want = local_engine({"target": TabularModel("target", 5, seed=9)}, VocabTokenizer(5)).generate(
        GenerationRequest(strategy="autoregressive", **req)).token_ids
    got = engine.generate(GenerationRequest(strategy="speculative", options={"drafter": "d", "k": 4}, **req))
    assert got.token_ids == want and side.counters.fills == 0 and not side.counters.hits


def test_a_speculator_that_is_mostly_late_is_asked_only_now_and_then():
    """Most answers late at the least fan-out: the near side backs off to a probe of PROBE_FILLS fills in a row
    every PROBE_EVERY steps (its drafting would only take the coordinator's core); answers in time again bring it
    back."""
    f = FanOut(rows=1, depth=2, min_rows=1, min_depth=2)
    assert all(f.ask() for _ in range(3))
    for late in [True, True, False] * 6:                 # two of three late: the share in time falls below half
        f.answered(not late)
    assert f.on_time < FanOut.BACK_OFF_BELOW
    asked = [f.ask() for _ in range(3 * FanOut.PROBE_EVERY + 1)]
    assert sum(asked) == 3 * FanOut.PROBE_FILLS == 6 and asked[FanOut.PROBE_EVERY - 1] and asked[FanOut.PROBE_EVERY]
    for _ in range(8):
        f.answered(True)
    assert all(f.ask() for _ in range(3))
    wide = FanOut(rows=3, depth=4)                       # not at the least fan-out: never backs off
    for _ in range(2):
        wide.answered(False)
    assert all(wide.ask() for _ in range(20))


def test_only_a_fill_for_requests_the_speculator_drafted_the_step_before_is_judged():
    """A late answer to a fill that first catches the speculator up (a new request, or one it was not asked about
    the step before) leaves the fan-out as it was; the next fill's late answer shrinks it."""
    d = TabularModel("d", 5, seed=40)
    side = near_far({"d": d}, {"d": TabularModel("d", 5, seed=40)}, delay=1, rows=3, sampled=False)
    spec = DraftSpec("propose", ("d",))
    side.prefill_batch([("r", [1, 2], SamplingParams(0.0), 0)])
    side.draft_batch([("r", spec, 2, 20)])               # the first fill: the speculator prefills its branches
    side.extend("r", [3])
    side.draft_batch([("r", spec, 2, 20)])               # its answer is late, not judged; the second fill is
    assert side.counters.late == 1 and (side.fanout.rows, side.fanout.on_time) == (3, 1.0)
    side.extend("r", [4])
    side.draft_batch([("r", spec, 2, 20)])
    assert side.counters.late == 2 and side.fanout.rows == 2 and side.fanout.on_time < 1.0


def test_late_answers_shrink_the_fan_out_and_outputs_stay_exact():
    """Every answer arrives after near drafted (dropped: it was for the step before): the fan-out falls to its
    least, the side backs off, nothing from the cache is used, and greedy outputs equal plain decoding."""
    target, d = TabularModel("target", 5, seed=9), TabularModel("d", 5, seed=40)
    side = near_far({"d": d}, {"d": TabularModel("d", 5, seed=40)}, delay=3, sampled=False)
    engine = local_engine({"target": target, "d": d, DRAFTS: side}, VocabTokenizer(5))
    req = dict(prompt_ids=[1, 2], max_new_tokens=60, sampling=SamplingParams(0.0), seed=0)
    want = local_engine({"target": TabularModel("target", 5, seed=9)}, VocabTokenizer(5)).generate(
        GenerationRequest(strategy="autoregressive", **req)).token_ids
    got = engine.generate(GenerationRequest(strategy="speculative", options={"drafter": "d", "k": 2}, **req))
    c = side.counters
    assert got.token_ids == want and not c.hits and c.late > 0 and c.wasted > 0
    assert (side.fanout.rows, side.fanout.depth) == (side.fanout.min_rows, side.fanout.min_depth)
    assert c.late_fills < c.steps - 2                    # backed off: not every step was asked


def test_the_cache_salt_reaches_the_speculators_drafters():
    """A salted request's speculator branches are prefilled with its salt, as its near drafter is."""
    from cluster.core.calls import PrefillItem

    class Recording(TabularModel):
        def prefill_batch(self, items):
            self.salts = getattr(self, "salts", set()) | {PrefillItem.of(it).salt for it in items}
            super().prefill_batch(items)

    target, d, copy = TabularModel("target", 5, seed=9), Recording("d", 5, seed=9), Recording("d", 5, seed=9)
    side = near_far({"d": d}, {"d": copy}, sampled=False)
    engine = local_engine({"target": target, "d": d, DRAFTS: side}, VocabTokenizer(5))
    engine.generate(GenerationRequest(prompt_ids=[1, 2], max_new_tokens=12, sampling=SamplingParams(0.0), seed=0,
                                      strategy="speculative", options={"drafter": "d", "k": 2}, cache_salt="t-1"))
    assert side.counters.fills > 0 and d.salts == {"t-1"} == copy.salts
