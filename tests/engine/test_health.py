"""Models going down and coming back, and server-side deadlines (cluster.engine.health, Engine.step).

A drafter that stops answering makes its requests continue on the target alone (same output law for lossless
strategies, exact by enumeration); when it answers again its requests are prefilled there and speculation
resumes.  The target going down fails its requests with ModelUnavailableError and refuses new ones until it
answers again.  A request past its deadline ends with DeadlineExceededError and its state is freed.
"""
from __future__ import annotations

import pytest

from cluster.core.draft.programs import DRAFTS
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import DeadlineExceededError, ModelUnavailableError
from tests.support.exact import (
    TabularModel,
    VocabTokenizer,
    enumerate_outcomes,
    local_engine,
    max_abs_diff,
    target_joint,
)

V = 3


class Flaky(TabularModel):
    """A tabular model that raises ModelUnavailableError while ``down`` (as a dead actor's handle does) and
    loses every request's state when it goes down (a restarted actor starts empty)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.down = False
        self.prefills = 0

    def go_down(self):
        self.down, self.seqs = True, {}

    def probe(self) -> bool:
        return not self.down

    def _check(self):
        if self.down:
            raise ModelUnavailableError(self.name, "gone")

    def prefill(self, rid, ids, sampling, seed):
        self._check()
        self.prefills += 1
        super().prefill(rid, ids, sampling, seed)

    def propose(self, rid, k):
        self._check()
        return super().propose(rid, k)

    def score(self, rid, draft):
        self._check()
        return super().score(rid, draft)

    def rollback(self, rid, length):
        if not self.down and rid in self.seqs:
            super().rollback(rid, length)

    def extend(self, rid, ids):
        if not self.down and rid in self.seqs:
            super().extend(rid, ids)


def _req(rid, n, sampling, prompt=(0, 1), **options):
    return GenerationRequest(prompt_ids=list(prompt), max_new_tokens=n, sampling=sampling, seed=1,
                             strategy="speculative", options={"drafter": "d", "k": 2, **options}, request_id=rid)


def test_dead_drafter_keeps_the_target_distribution_exactly():
    """The drafter dies after the first step: later steps run on the target alone; the output law of every
    request is still the target's (exact enumeration, two concurrent requests)."""
    holder = {}
    target = TabularModel("target", V, seed=11)
    drafter = Flaky("d", V, seed=12, zeros=True)
    engine = local_engine({"target": target, "d": drafter}, VocabTokenizer(V), rng_factory=lambda s: holder["rng"])
    sampling = SamplingParams(1.0)

    def run(rng):
        holder["rng"] = drafter.rng = rng
        drafter.down = False
        engine.health.down.clear()
        a = engine.add(_req("a", 3, sampling, prompt=(0,)))
        b = engine.add(_req("b", 3, sampling, prompt=(1, 2)))
        engine.step()
        drafter.go_down()
        while engine.has_work:
            engine.step()
        assert a.error is None and b.error is None
        return tuple(a.generated), tuple(b.generated)

    got = enumerate_outcomes(run)
    for i, prompt in enumerate(([0], [1, 2])):
        marginal = {}
        for outcome, w in got.items():
            marginal[outcome[i]] = marginal.get(outcome[i], 0.0) + w
        assert max_abs_diff(marginal, target_joint(target, prompt, 3, sampling)) < 1e-9


def test_drafter_comes_back_requests_are_prefilled_and_speculate_again():
    target = TabularModel("target", V, seed=3)
    drafter = Flaky("d", V, seed=3)                      # the same table as the target: drafts accepted
    greedy = SamplingParams(0.0)
    engine = local_engine({"target": target, "d": drafter}, VocabTokenizer(V))
    ref = local_engine({"target": TabularModel("target", V, seed=3)}, VocabTokenizer(V))
    want = ref.generate(GenerationRequest(prompt_ids=[0, 1], max_new_tokens=12, sampling=greedy, seed=1,
                                          strategy="autoregressive")).token_ids
    seq = engine.add(_req("r", 12, greedy))
    engine.step()
    drafter.go_down()
    engine.step()                                        # drafter call fails: this step runs on the target
    assert DRAFTS in engine.health.down and DRAFTS in seq.stale      # the draft side, which hosts "d"
    steps_while_down = seq.stats.steps
    engine.step()                                        # still down: a target-only step, no drafting
    assert seq.stats.steps == steps_while_down
    drafter.down = False                                 # the actor is back (empty)
    prefills = drafter.prefills
    engine.step()
    assert drafter.prefills == prefills + 1 and not seq.stale and not engine.health.down
    assert drafter.seqs["r"][:len(seq.ctx.tokens) - 1] == seq.ctx.tokens[:-1]
    while engine.has_work:
        engine.step()
    assert seq.stats.steps > steps_while_down            # speculation resumed
    assert seq.generated == want                         # greedy output unchanged through the outage
    assert not target.seqs and not drafter.seqs


def test_dead_target_fails_requests_refuses_new_ones_until_it_answers():
    target = Flaky("target", V, seed=5)
    engine = local_engine({"target": target}, VocabTokenizer(V))
    greedy = SamplingParams(0.0)
    seq = engine.add(GenerationRequest(prompt_ids=[0], max_new_tokens=5, sampling=greedy, strategy="autoregressive"))
    engine.step()
    target.go_down()
    engine.step()
    assert isinstance(seq.error, ModelUnavailableError) and "retry" in str(seq.error)
    with pytest.raises(ModelUnavailableError):
        engine.add(GenerationRequest(prompt_ids=[0], max_new_tokens=2, sampling=greedy, strategy="autoregressive"))
    target.down = False
    ok = engine.generate(GenerationRequest(prompt_ids=[0], max_new_tokens=2, sampling=greedy,
                                           strategy="autoregressive"))
    assert len(ok.token_ids) == 2 and not engine.has_work


@pytest.mark.parametrize("strategy,options", [("speculative", {"drafter": "d", "k": 2}), ("autoregressive", {})])
def test_a_request_the_target_lost_resumes_with_the_target_law_exactly(strategy, options):
    """The target dies after the first step (losing every request's state) and comes back: with a resume limit
    the request waits and goes on from its committed tokens; every draw enumerated, its law is still the
    target's, and the dead step emitted nothing."""
    holder = {}
    target = Flaky("target", V, seed=13)
    drafter = TabularModel("d", V, seed=14, zeros=True)
    engine = local_engine({"target": target, "d": drafter}, VocabTokenizer(V), rng_factory=lambda s: holder["rng"],
                          resume_limit=2)
    sampling = SamplingParams(1.0)

    def run(rng):
        holder["rng"] = drafter.rng = rng
        target.down = False
        engine.health.down.clear()
        seq = engine.add(GenerationRequest(prompt_ids=[1, 2], max_new_tokens=3, sampling=sampling, seed=1,
                                           strategy=strategy, options=options, request_id="r"))
        engine.step()
        emitted = list(seq.generated)
        target.go_down()
        engine.step()
        assert seq.resumes == 1 and seq.error is None and seq.generated == emitted
        target.down = False
        while engine.has_work:
            engine.step()
        assert seq.error is None and [t for c in seq.chunks for t in c.token_ids] == seq.generated
        return tuple(seq.generated)

    got = enumerate_outcomes(run)
    assert max_abs_diff(got, target_joint(target, [1, 2], 3, sampling)) < 1e-9


def test_deadline_ends_the_request_and_frees_its_state():
    target, drafter = TabularModel("target", V, seed=1), TabularModel("d", V, seed=2)
    engine = local_engine({"target": target, "d": drafter}, VocabTokenizer(V), request_timeout_s=60.0)
    slow = engine.add(_req("slow", 20, SamplingParams(0.0)))
    other = engine.add(_req("other", 3, SamplingParams(0.0)))
    assert slow.deadline == pytest.approx(slow.t0 + 60.0)
    engine.step()
    slow.deadline = slow.t0                              # its time is up (no sleeping in tests)
    engine.step()
    assert slow.finish == "deadline" and isinstance(slow.error, DeadlineExceededError)
    assert "slow" not in target.seqs and "slow" not in drafter.seqs
    while engine.has_work:
        engine.step()
    assert other.finish == "length" and other.error is None
