"""The miss path's race against a late speculator answer (cluster.core.draft.race): the far block is taken at the
round its answer arrives (greedy: always; sampled: when it begins with near's draws so far), exact output laws for
every round of arrival, alone and batched, greedy outputs equal to plain decoding, and the counters."""
from __future__ import annotations

import pytest

from cluster.core.draft.cache import Entry, FanOut
from cluster.core.draft.near_far import LocalLink, NearFarSide, SpeculatorLink
from cluster.core.draft.programs import DRAFTS, DraftBlock, DraftSpec
from cluster.core.draft.race import Race
from cluster.core.draft.side import DraftSide
from cluster.core.draft.speculator import Reply, Speculator
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.strategies import resolve_options
from tests.support.exact import (
    TabularModel,
    VocabTokenizer,
    enumerate_outcomes,
    local_engine,
    max_abs_diff,
    mixed_batch,
    steps_law,
    target_joint,
)

# LocalLink(delay=d): the answer is readable at the (d+1)-th poll after its fill; the step's start polls once, then
# the race before each drafting round: d = 1 -> before near's first round (j = 0), d = 2 -> after one near token
# (j = 1), d = k + 1 -> after near finished (late: near's block)


def near_far(drafters: dict, copies: dict, *, rng=None, delay: int = 0, rows: int = 2, sampled: bool = True):
    """A near-far side whose speculator answers ``delay`` polls late, drafting ``rows`` branches per fill always
    (a fan-out that late answers do not shrink: every race has branches to take)."""
    kw = {} if rng is None else dict(rng_factory=lambda s: rng)
    return NearFarSide(DraftSide(drafters, **kw), LocalLink(Speculator(copies, **kw), delay),
                       fanout=FanOut(rows=rows, min_rows=rows, max_rows=rows), sampled=sampled,
                       max_rows=8)


@pytest.mark.parametrize("opts,sampling,delay", [
    pytest.param(dict(drafter="d", k=2), SamplingParams(1.0), 1,           # arrives before near's first round;
                 marks=pytest.mark.slow),                                  # ~75 s: the batched race tests cover it
    pytest.param(dict(drafter="d", k=2), SamplingParams(1.0), 2,           # after near's first token; ~2 min:
                 marks=pytest.mark.slow),                                  # the slow suite's
    pytest.param(dict(drafter="d", k=2, verify="block"), SamplingParams(0.8), 2,   # ~1 min: the slow suite's
                 marks=pytest.mark.slow),
    (dict(drafter="d", k=2), SamplingParams(1.0, top_k=2), 3),             # after near finished: near's block
])
def test_the_race_keeps_the_target_law_exactly(opts, sampling, delay):
    """Every draw enumerated (near's, the speculator's branches', the target's): the first three tokens follow the
    target exactly whichever round the answer arrives at; some paths did take a raced block."""
    target = TabularModel("target", 3, seed=5)
    d = TabularModel("d", 3, seed=6, zeros=True)
    sides = []

    def side(drafters, rng):
        sides.append(near_far(drafters, {"d": TabularModel("d", 3, seed=6, zeros=True, rng=rng)}, rng=rng,
                              delay=delay))
        return sides[-1]

    got = steps_law("speculative", resolve_options("speculative", opts, {}), {"target": target, "d": d}, "target",
                    [0, 1], sampling, 3, 4, side=side)
    assert max_abs_diff(got, target_joint(target, [0, 1], 3, sampling)) < 1e-9
    raced = sum(s.counters.raced for s in sides)
    assert (raced > 0) == (delay <= opts["k"])
    if delay == 2:                                       # raced after one near token, on some paths only (agreeing)
        assert all(s.counters.raced_rounds == s.counters.raced for s in sides)
        assert any(s.counters.late and not s.counters.raced for s in sides)


@pytest.mark.parametrize("delay", [1, 2])
def test_the_race_batched_is_exact_per_request(delay):
    """A sampled request and a greedy one in one batch, k = 2, the answer arriving before near's first round or
    after its first token: the sampled one's law is the target's, the greedy one is the target's argmax path.
    (With 5 tokens per request the steps after the first draft one token near, so delay 2 comes after near: the
    batched splice after near's first token needs longer requests than enumeration affords here.)"""
    target, d = TabularModel("target", 3, seed=21), TabularModel("d", 3, seed=22, zeros=True)
    copy = TabularModel("d", 3, seed=22, zeros=True)
    sampling, greedy = SamplingParams(1.0), SamplingParams(0.0)
    want_greedy = target_joint(target, [2, 1], 3, greedy)
    sides = []

    def run(rng):
        d.rng = copy.rng = rng
        sides.append(near_far({"d": d}, {"d": copy}, rng=rng, delay=delay, rows=4))
        engine = local_engine({"target": target, "d": d, DRAFTS: sides[-1]}, VocabTokenizer(3),
                              rng_factory=lambda s: rng)
        return mixed_batch(engine, sampling, want_greedy, k=2)

    got = enumerate_outcomes(run)
    assert max_abs_diff(got, target_joint(target, [0], 3, sampling)) < 1e-9
    assert (sum(s.counters.raced for s in sides) > 0) == (delay == 1)
    assert not target.seqs and not d.seqs and not sides[-1].active_requests()


@pytest.mark.parametrize("seed_d,delay", [(9, 1), (40, 2), (40, 3)])
def test_greedy_outputs_equal_plain_decoding_with_raced_blocks(seed_d, delay):
    """Greedy, batched, every answer late by a round or two: outputs equal the target's, late answers are raced
    (their blocks counted as hits and as raced, with the near rounds done before them)."""
    target, d = TabularModel("target", 5, seed=9), TabularModel("d", 5, seed=seed_d)
    side = near_far({"d": d}, {"d": TabularModel("d", 5, seed=seed_d)}, delay=delay, rows=3, sampled=False)
    engine = local_engine({"target": target, "d": d, DRAFTS: side}, VocabTokenizer(5))
    plain = local_engine({"target": TabularModel("target", 5, seed=9)}, VocabTokenizer(5))
    reqs = [dict(prompt_ids=p, max_new_tokens=30, sampling=SamplingParams(0.0), seed=0, request_id=f"r{i}")
            for i, p in enumerate(([1, 2], [3], [4, 0, 1]))]
    want = [r.token_ids for r in plain.generate_many([GenerationRequest(strategy="autoregressive", **q)
                                                      for q in reqs])]
    got = engine.generate_many([GenerationRequest(strategy="speculative", options={"drafter": "d", "k": 4}, **q)
                                for q in reqs])
    assert [r.token_ids for r in got] == want
    c = side.counters
    # ``known`` hits: a miss step's own block drafted far from the committed sequence it sent before drafting near
    # (NearFarSide._outcome), raced after ``delay`` near rounds; every late answer's after delay - 1 (the step's
    # first poll was one)
    known = c.hits["known"]
    assert known > 0 and c.raced > known and c.late >= c.raced - known and sum(c.hits.values()) >= c.raced
    assert c.raced_rounds == (delay - 1) * (c.raced - known) + delay * known
    assert not side.active_requests() and not d.seqs and not side.link.speculator.side.members["d"].seqs


class _Link(SpeculatorLink):
    """Answers only what the test hands it."""

    def __init__(self):
        self.replies = []

    def send(self, fill) -> bool:
        return True

    def poll(self) -> list:
        out, self.replies = self.replies, []
        return out


def test_a_sampled_block_is_raced_only_when_it_begins_with_nears_draws():
    """The race's rule, literally: a sampled far block that does not begin with near's draws so far is not taken
    (near's block is, the far one wasted); one that does is; a greedy one is taken whatever near drew; the answer
    is looked at once, at the round it arrives."""
    link = _Link()
    side = NearFarSide(DraftSide({"d": TabularModel("d", 5, seed=3)}), link, sampled=True)
    spec = DraftSpec("propose", ("d",))
    side.prefill_batch([("s", [0, 1], SamplingParams(1.0), 0), ("g", [0, 2], SamplingParams(0.0), 0)])
    items = [("s", spec, 3, 10), ("g", spec, 3, 10)]
    near = {0: [4], 1: [4]}                         # near drew token 4 for both so far

    def answer(first_s: int) -> None:
        link.replies = [Reply(side._sent, {"s": [Entry([0, 1], spec, DraftBlock([first_s, 2, 2]), ("bonus", -1, 0))],
                                           "g": [Entry([0, 2], spec, DraftBlock([1, 1]), ("reject", 0, 0))]}, 2, 5)]

    def fill_out() -> Race:
        side._waiting, side._sent = ["s", "g"], side._sent + 1
        return Race(side, items)

    race = fill_out()
    assert race(near) == [] and race.rounds == 1    # no answer yet
    answer(3)                                       # its answer arrives
    assert race(near) == [1]                        # the greedy one only: the sampled block begins with 3, not 4
    blocks = race.settle([DraftBlock([4, 0, 0]), "stopped"])
    assert [b.tokens for b in blocks] == [[4, 0, 0], [1, 1]]
    c = side.counters
    assert (c.raced, c.raced_rounds, c.hits["reject"], c.wasted) == (1, 1, 1, 3)
    race = fill_out()
    answer(4)
    assert sorted(race(near)) == [0, 1] and race({0: [4], 1: [4]}) == []      # looked at once
    assert [b.tokens for b in race.settle(["stopped", "stopped"])] == [[4, 2, 2], [1, 1]]
    assert (c.raced, c.raced_rounds, c.hits["bonus"]) == (3, 1, 1)
    race = fill_out()
    answer(4)
    assert race({1: None}) == [1]                   # near finished the sampled one: its block stays near's
