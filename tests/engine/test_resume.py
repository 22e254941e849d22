"""Resumed requests (issue: streams that survive a lost replica): a request continued from its prompt and the
tokens it already emitted, with the same seed, goes on exactly as the uninterrupted request would have -- greedy
and seeded sampling, every lossless strategy, with and without a grammar, stop strings and logprobs over the
whole request -- both as a client's continuation (``resume_ids``) and inside the engine when the target loses
every request's state mid-stream (``Engine._suspend``): the stream then has every token once, in order.
"""
from __future__ import annotations

import dataclasses

import pytest

from cluster.config.schema import MagSpec, load_config
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ModelUnavailableError, ParamError
from cluster.models.grammar import json_grammar
from tests.engine.test_constrained_models import PROMPT as JSON_PROMPT, SCHEMA
from tests.support.built import engine_for

PROMPT = "def fibonacci(n):\n    "
CASES = [("autoregressive", {}), ("speculative", {}), ("speculative", {"verify": "block", "k": 5}), ("mag", {}),
         ("cs_drafting", {"drafters": "drafter-large,drafter-small,mag"})]
SAMPLINGS = {"greedy": SamplingParams(0.0), "T0.8": SamplingParams(0.8, top_p=0.95)}


@pytest.fixture(scope="module")
def engine():
    cfg = load_config("configs/tiny.yaml")
    return engine_for(dataclasses.replace(cfg, mag=MagSpec()))


def _req(strategy, options, sampling, grammar=None, **kw):
    return GenerationRequest(prompt=JSON_PROMPT if grammar else PROMPT, max_new_tokens=kw.pop("n", 40),
                             sampling=sampling, seed=kw.pop("seed", 5), strategy=strategy, options=dict(options),
                             grammar=grammar, ignore_eos=grammar is None, **kw)


def _chunks(engine, req):
    return list(engine.stream(req))


def _cut(chunks, at: int) -> list[int]:
    """The ids of the first ``at`` chunks (a cut at a step boundary, as a stream is cut)."""
    return [t for c in chunks[:at] for t in c.token_ids]


@pytest.mark.parametrize("strategy,options", CASES, ids=[f"{s}-{'-'.join(map(str, o.values()))}" for s, o in CASES])
@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_a_continuation_goes_on_exactly_as_the_uninterrupted_request(engine, strategy, options, sampling):
    whole = _chunks(engine, _req(strategy, options, SAMPLINGS[sampling], logprobs=1, stop=("\n\n\n",)))
    want = whole[-1].result
    assert len(whole) >= 4
    for at in (1, len(whole) // 2, len(whole) - 1):
        resumed = _cut(whole, at)
        rest = _chunks(engine, _req(strategy, options, SAMPLINGS[sampling], logprobs=1, stop=("\n\n\n",),
                                    resume_ids=resumed))
        got = rest[-1].result
        assert got.token_ids == want.token_ids and got.text == want.text, (at, got.text, want.text)
        assert resumed + [t for c in rest for t in c.token_ids] == want.token_ids       # none twice, none lost
        assert "".join(c.text for c in whole[:at]) + "".join(c.text for c in rest) == want.text
        assert got.stats.generated_tokens == len(want.token_ids) and got.finish_reason == want.finish_reason
        assert [lp.token_id for lp in got.logprobs] == want.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got.logprobs, want.logprobs)) < 1e-4


@pytest.mark.parametrize("strategy,options", [("speculative", {}), ("cs_drafting", {})])
def test_a_grammar_continuation_replays_its_state_from_the_emitted_tokens(engine, strategy, options):
    grammar = json_grammar(SCHEMA, engine.tokenizer)
    sampling = SamplingParams(1.0)
    whole = _chunks(engine, _req(strategy, options, sampling, grammar, n=120, seed=3))
    assert whole[-1].result.finish_reason == "eos"
    resumed = _cut(whole, len(whole) // 2)
    got = engine.generate(_req(strategy, options, sampling, grammar, n=120, seed=3, resume_ids=resumed))
    assert got.token_ids == whole[-1].result.token_ids and got.text == whole[-1].result.text


def test_a_continuation_is_checked(engine):
    ok = _req("speculative", {}, SamplingParams(0.8), n=8)
    for bad, allowed in (([1] * 8, "fewer token ids than the 8 new tokens"), ([10 ** 9], "token ids in"),
                         ([engine.tokenizer.eos_token_id], "without the end-of-text")):
        with pytest.raises(ParamError, match="resume_ids") as e:
            engine.prepare(dataclasses.replace(ok, resume_ids=bad, ignore_eos=False))
        assert allowed in str(e.value)
    with pytest.raises(ParamError, match="seed"):
        engine.prepare(dataclasses.replace(ok, resume_ids=[1], seed=None))
    assert engine.prepare(dataclasses.replace(ok, resume_ids=[1], seed=None,
                                              sampling=SamplingParams(0.0))).resumed == (1,)


class Dying:
    """A target handle that dies as an actor does: while ``down`` every call raises ModelUnavailableError and
    the probe fails; going down loses every request's state (a restarted actor starts empty)."""

    def __init__(self, inner):
        self.inner, self.down = inner, False

    def go_down(self):
        self.down = True
        for rid in list(self.inner.active_requests()):
            self.inner.release(rid)
        self.inner.flush()

    def probe(self) -> bool:
        return not self.down

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr) or name in ("release", "flush", "active_requests"):
            return attr

        def call(*a, **kw):
            if self.down:
                raise ModelUnavailableError(self.inner.name, "gone (its actor died)")
            return attr(*a, **kw)
        return call


@pytest.mark.parametrize("strategy,options", CASES[1:], ids=[s for s, _ in CASES[1:]])
def test_a_request_whose_target_died_resumes_exactly_when_it_is_back(engine, strategy, options):
    """Two requests stream; the target dies after two steps and comes back empty: both go on from their emitted
    tokens, equal to their uninterrupted twins token for token (seeded sampling), every token streamed once."""
    reqs = [_req(strategy, options, SAMPLINGS["T0.8"], seed=s, request_id=f"r{s}") for s in (1, 2)]
    want = [engine.generate(r).token_ids for r in reqs]
    target = engine.models[engine.target]
    engine.models[engine.target] = dying = Dying(target)
    try:
        seqs = [engine.add(r) for r in reqs]
        engine.step()
        engine.step()
        dying.go_down()
        engine.step()                                       # the step fails: both wait for the target
        assert all(s.resumes == 1 and s.error is None for s in seqs) and engine.target_down
        emitted = [len(s.generated) for s in seqs]
        engine.step()                                       # still down: nothing runs, nobody fails
        assert [len(s.generated) for s in seqs] == emitted and engine.has_work
        dying.down = False
        while engine.has_work:
            engine.step()
        for s, ids in zip(seqs, want):
            assert s.error is None and s.result.token_ids == ids
            assert [t for c in s.chunks for t in c.token_ids] == ids
    finally:
        engine.models[engine.target] = target
    assert not target.active_requests()


def test_the_resume_limit_bounds_the_retries(engine):
    target = engine.models[engine.target]
    engine.models[engine.target] = dying = Dying(target)
    limit, engine.resume_limit = engine.resume_limit, 1
    try:
        seq = engine.add(_req("speculative", {}, SAMPLINGS["greedy"]))
        engine.step()
        for _ in range(2):
            dying.go_down()
            engine.step()
            dying.down = False
            engine.step()
        assert isinstance(seq.error, ModelUnavailableError) and seq.resumes == 1
    finally:
        engine.models[engine.target], engine.resume_limit = target, limit
        while engine.has_work:
            engine.step()
