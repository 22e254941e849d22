"""Admission and the continuous batch, literally: max_batch, arrival order, queue overflow, the KV budget,
abort (waiting and running), failures confined to one model group, and a stream closed early.
All on tabular handles (no torch models), with step-by-step expectations."""
from __future__ import annotations

import numpy as np
import pytest

from cluster.core.sampling import Rng, SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.engine.scheduler import Limits, Scheduler
from cluster.engine.sequence import FINISHED, RUNNING, WAITING
from cluster.errors import OverloadedError, ParamError
from cluster.models.maxgram import MagHandle
from tests.support.exact import TabularModel, VocabTokenizer
from tests.support.exact import local_engine

V = 4


class Failing(TabularModel):
    """A tabular drafter whose ``fail`` operations raise."""

    def __init__(self, *args, fail=("propose",), **kwargs):
        super().__init__(*args, **kwargs)
        self.fail = set(fail)

    def prefill(self, rid, ids, sampling, seed):
        if "prefill" in self.fail:
            raise RuntimeError(f"{self.name}: prefill exploded")
        super().prefill(rid, ids, sampling, seed)

    def propose(self, rid, k):
        if "propose" in self.fail:
            raise RuntimeError(f"{self.name}: propose exploded")
        return super().propose(rid, k)


def _engine(limits=None, **extra):
    models = {"target": TabularModel("target", V, seed=1), "d": TabularModel("d", V, seed=2, rng=Rng(5)),
              "mag": MagHandle(V, np.array([1, 2, 3, 0])), **extra}
    return local_engine(models, VocabTokenizer(V), limits=limits or Limits()), models


def _req(rid, n=2, prompt=(0, 1), strategy="autoregressive", **options):
    return GenerationRequest(prompt_ids=list(prompt), max_new_tokens=n, sampling=SamplingParams(1.0), seed=3,
                             strategy=strategy, options=options, request_id=rid)


def _state(models) -> dict[str, list[str]]:
    """Request ids each handle holds state for."""
    return {name: sorted(h.seqs if isinstance(h, TabularModel) else h.active_requests())
            for name, h in models.items()}


def _empty(models) -> bool:
    return all(not ids for ids in _state(models).values())


def _record_joins(engine) -> list[list[str]]:
    """Wrap the scheduler so every step's joined request ids are recorded."""
    joins, schedule = [], engine.scheduler.schedule

    def spy():
        joined = schedule()
        joins.append([s.rid for s in joined])
        return joined
    engine.scheduler.schedule = spy
    return joins


# -- max_batch and arrival order ----------------------------------------------------------------

def test_max_batch_and_arrival_order_step_by_step():
    """autoregressive emits one token per step, so who runs when is fully determined."""
    engine, models = _engine(Limits(max_batch=2, max_queue=10))
    joins = _record_joins(engine)
    for rid, n in [("r0", 1), ("r1", 3), ("r2", 2), ("r3", 2), ("r4", 1)]:
        engine.add(_req(rid, n))
    ended, running = [], []
    while engine.has_work:
        ended.append(sorted(s.rid for s in engine.step()))
        running.append([s.rid for s in engine.scheduler.running])
        assert len(engine.scheduler.running) <= 2
    assert joins == [["r0", "r1"], ["r2"], [], ["r3", "r4"], []]
    assert ended == [["r0"], [], ["r1", "r2"], ["r4"], ["r3"]]
    assert running == [["r1"], ["r1", "r2"], [], ["r3"], []]
    assert engine.scheduler.kv_reserved == 0 and _empty(models)


def test_requests_added_between_steps_join_at_the_next_step_in_order():
    engine, models = _engine(Limits(max_batch=3))
    joins = _record_joins(engine)
    a = engine.add(_req("a", 6, strategy="speculative", drafter="d", k=1))
    engine.step()
    b, c = engine.add(_req("b", 3, prompt=(2,))), engine.add(_req("c", 8, prompt=(1, 2, 3, 0, 1), strategy="mag"))
    assert (b.status, c.status) == (WAITING, WAITING) and "b" not in _state(models)["target"]
    engine.step()
    assert joins == [["a"], ["b", "c"]] and b.status == c.status == RUNNING
    assert _state(models)["target"] == ["a", "b", "c"] and _state(models)["mag"] == []   # c's first step: target only
    engine.step()
    assert _state(models)["mag"] == ["c"]                 # then c drafts with the Max-Gram drafter
    d = engine.add(_req("d", 1))                        # batch full: waits, then joins in order
    while engine.has_work:
        engine.step()
        assert len(engine.scheduler.running) <= 3
    assert [j for j in joins if j] == [["a"], ["b", "c"], ["d"]]
    assert all(len(s.generated) == s.req.max_new_tokens and s.finish == "length" for s in (a, b, c, d))
    assert _empty(models)


def test_generate_many_respects_max_batch_and_returns_in_order():
    engine, models = _engine(Limits(max_batch=2))
    peak = []
    step = engine.step
    engine.step = lambda: (step(), peak.append(len(engine.scheduler.running)))[0]
    results = engine.generate_many([_req(f"g{i}", n) for i, n in enumerate([3, 1, 2, 2, 1])])
    assert [r.request_id for r in results] == ["g0", "g1", "g2", "g3", "g4"]
    assert [len(r.token_ids) for r in results] == [3, 1, 2, 2, 1]
    assert max(peak) == 2 and _empty(models)


# -- queue overflow -----------------------------------------------------------------------------

def test_queue_overflow_is_refused_naming_the_limits():
    engine, models = _engine(Limits(max_batch=2, max_queue=3))
    for i in range(5):                                  # 2 join at the next step + 3 queued
        engine.add(_req(f"q{i}", 3))
    with pytest.raises(OverloadedError, match=r"0 running and 5 waiting") as err:
        engine.add(_req("q5", 3))
    assert "max_batch 2" in str(err.value) and "max_queue 3" in str(err.value)
    engine.step()                                       # 2 running, 3 waiting: still full
    assert [len(engine.scheduler.running), len(engine.scheduler.waiting)] == [2, 3]
    with pytest.raises(OverloadedError, match=r"2 running and 3 waiting \(max_batch 2, max_queue 3\)"):
        engine.add(_req("q5", 3))
    assert "q5" not in engine._live                    # a refused request leaves nothing behind
    while len(engine.scheduler.waiting) == 3:
        engine.step()
    engine.add(_req("q5", 3))                           # room again once the queue moved
    while engine.has_work:
        engine.step()
    assert _empty(models)


def test_zero_queue_admits_only_what_joins_next_step():
    engine, _ = _engine(Limits(max_batch=2, max_queue=0))
    engine.add(_req("a", 2))
    engine.add(_req("b", 2))
    with pytest.raises(OverloadedError):
        engine.add(_req("c", 2))
    engine.step()
    with pytest.raises(OverloadedError):
        engine.add(_req("c", 2))
    engine.step()                                       # both finished: room for two
    engine.add(_req("c", 2))


# -- KV budget ----------------------------------------------------------------------------------

def test_kv_budget_refuses_what_can_never_fit():
    engine, _ = _engine(Limits(kv_budget_tokens=20))
    with pytest.raises(OverloadedError, match=r"needs 21 KV positions .*engine.kv_budget_tokens = 20"):
        engine.add(_req("big", 18, prompt=(0, 1)))      # 2 + 18 + 1
    engine.add(_req("exact", 17, prompt=(0, 1)))        # 2 + 17 + 1 = 20 fits exactly
    assert not engine.scheduler.running and len(engine.scheduler.waiting) == 1


def test_kv_budget_requests_wait_until_budget_frees():
    engine, models = _engine(Limits(max_batch=8, kv_budget_tokens=20))
    joins = _record_joins(engine)
    a = engine.add(_req("a", 2, prompt=(0, 1, 2, 3, 0, 1)))          # 6 + 2 + 1 = 9
    b = engine.add(_req("b", 4, prompt=(1, 2, 3, 0, 1, 2)))          # 6 + 4 + 1 = 11 -> 20 in all
    c = engine.add(_req("c", 1, prompt=(3,)))                        # 1 + 1 + 1 = 3: must wait (FIFO)
    d = engine.add(_req("d", 1, prompt=(2,)))                        # behind c
    reserved = []
    while engine.has_work:
        engine.step()
        reserved.append(engine.scheduler.kv_reserved)
        assert engine.scheduler.kv_reserved <= 20
    # a ends at step 2, freeing 9: c and d join at step 3 (3 + 3 + 11 <= 20); b ends at step 4
    assert joins[:3] == [["a", "b"], [], ["c", "d"]]
    assert reserved == [20, 11, 11, 0]
    assert all(s.finish == "length" for s in (a, b, c, d)) and _empty(models)


def test_queue_limit_counts_requests_the_kv_budget_keeps_waiting():
    """Free batch places do not count as room when the KV budget keeps the queue from joining: with one
    request holding 15 of 20 positions, only max_queue = 1 more request of 15 may wait."""
    engine, _ = _engine(Limits(max_batch=4, max_queue=1, kv_budget_tokens=20))
    engine.add(_req("a", 12, prompt=(0, 1)))            # 2 + 12 + 1 = 15
    engine.step()
    engine.add(_req("b", 12, prompt=(0, 1)))            # waits for the budget
    with pytest.raises(OverloadedError, match="1 running and 1 waiting"):
        engine.add(_req("c", 12, prompt=(0, 1)))


def test_head_of_line_request_blocks_later_smaller_ones():
    """Arrival order is kept: a waiting request too large for the free budget is not overtaken."""
    engine, _ = _engine(Limits(max_batch=8, kv_budget_tokens=20))
    joins = _record_joins(engine)
    engine.add(_req("a", 3, prompt=(0,) * 10))                       # 14
    engine.add(_req("big", 5, prompt=(0,) * 10))                     # 16: waits for a
    engine.add(_req("small", 1, prompt=(1,)))                        # 3: would fit now, waits behind big
    while engine.has_work:
        engine.step()
    assert [j for j in joins if j] == [["a"], ["big", "small"]]


def test_scheduler_accounting_with_literal_sequences():
    class Seq:
        def __init__(self, reserved):
            self.reserved_tokens, self.status = reserved, WAITING

    s = Scheduler(Limits(max_batch=2, max_queue=1, kv_budget_tokens=10))
    x, y, z = Seq(4), Seq(6), Seq(1)
    for seq in (x, y, z):
        s.add(seq)
    with pytest.raises(OverloadedError):
        s.add(Seq(1))                                   # 2 places + 1 queued
    assert s.schedule() == [x, y] and s.kv_reserved == 10 and len(s) == 3
    assert s.schedule() == [] and z.status == WAITING
    s.remove(x)
    assert (x.status, s.kv_reserved, s.schedule(), s.kv_reserved) == (FINISHED, 6, [z], 7)
    s.remove(y), s.remove(z)
    assert s.kv_reserved == 0 and len(s) == 0


# -- abort --------------------------------------------------------------------------------------

def test_abort_waiting_and_running_frees_every_handle_and_the_id():
    engine, models = _engine(Limits(max_batch=1))
    run = engine.add(_req("run", 12, strategy="speculative", drafter="d", k=2))
    wait = engine.add(_req("wait", 6, strategy="mag"))
    engine.step()
    assert run.status == RUNNING and wait.status == WAITING
    assert _state(models) == {"target": ["run"], "d": [], "mag": []}       # its first step is the target's alone
    engine.step()
    assert _state(models) == {"target": ["run"], "d": ["run"], "mag": []}
    assert engine.abort("wait") and not engine.abort("nobody")
    with pytest.raises(ParamError, match="request_id"):             # still live until the step boundary
        engine.add(_req("wait", 2))
    assert [s.rid for s in engine.step()] == ["wait"]
    assert wait.finish == "cancelled" and wait.status == FINISHED and wait not in engine.scheduler.waiting
    assert run.status == RUNNING and len(run.generated) > 0
    assert engine.abort("run")
    ended = engine.step()
    assert [s.rid for s in ended] == ["run"] and run.finish == "cancelled" and run.status == FINISHED
    assert _empty(models) and not engine.has_work and engine.scheduler.kv_reserved == 0
    assert not engine.abort("run")
    # both ids are free again, and behave like fresh requests
    res = engine.generate_many([_req("run", 3, strategy="speculative", drafter="d", k=2),
                                _req("wait", 3, strategy="mag")])
    assert [len(r.token_ids) for r in res] == [3, 3] and _empty(models)


def test_abort_frees_the_place_for_a_waiting_request_in_the_same_step():
    engine, models = _engine(Limits(max_batch=1))
    joins = _record_joins(engine)
    engine.add(_req("a", 5))
    engine.add(_req("b", 1))
    engine.step()
    engine.abort("a")
    engine.step()
    assert joins == [["a"], ["b"]] and not engine.has_work and _empty(models)


# -- failures -----------------------------------------------------------------------------------

def test_failing_drafter_fails_only_its_group():
    engine, models = _engine(bad=Failing("bad", V, seed=9, rng=Rng(1)))
    ok = engine.add(_req("ok", 4, strategy="speculative", drafter="d", k=2))
    ar = engine.add(_req("ar", 4))
    mg = engine.add(_req("mg", 4, strategy="mag"))
    bad = engine.add(_req("bad", 4, strategy="speculative", drafter="bad", k=2))
    first = engine.step()                               # the target-only first step: nobody drafts yet
    assert first == [] and all(len(s.generated) == 1 for s in (ok, ar, mg, bad))
    ended = engine.step()
    assert [s.rid for s in ended if s.finish == "error"] == ["bad"]
    assert isinstance(bad.error, RuntimeError) and "propose exploded" in str(bad.error)
    assert all(s.error is None and len(s.generated) >= 2 for s in (ok, ar, mg))   # same step, unaffected
    assert "bad" not in _state(models)["target"] and not _state(models)["bad"]
    while engine.has_work:
        engine.step()
    assert all(s.finish == "length" and len(s.generated) == 4 for s in (ok, ar, mg)) and _empty(models)


def test_failing_prefill_fails_only_its_requests():
    engine, models = _engine(bad=Failing("bad", V, seed=9, rng=Rng(1), fail=("prefill",)))
    ok = engine.add(_req("ok", 3, strategy="speculative", drafter="d", k=2))
    bad = engine.add(_req("bad", 3, strategy="speculative", drafter="bad", k=2))
    engine.step()                                       # the target-only first step: drafters prefill next
    assert bad.finish is None and len(bad.generated) == 1
    engine.step()
    assert bad.finish == "error" and "prefill exploded" in str(bad.error)
    while engine.has_work:
        engine.step()
    assert ok.finish == "length" and len(ok.generated) == 3 and _empty(models)
    with pytest.raises(RuntimeError, match="prefill exploded"):     # generate surfaces the request's error
        engine.generate(_req("bad", 3, strategy="speculative", drafter="bad", k=2))
    assert _empty(models) and not engine.has_work


def test_failing_strategy_step_fails_only_its_request():
    from cluster.strategies import Score
    engine, models = _engine()
    ok = engine.add(_req("ok", 3))
    bad = engine.add(_req("bad", 3))

    def broken(ctx):                        # scores with the others, then raises inside the step
        yield Score("target", ())
        raise ValueError("strategy bug")
    bad.req.strategy.step = broken
    engine.step()
    assert bad.finish == "error" and "strategy bug" in str(bad.error)
    assert ok.error is None and len(ok.generated) == 1
    while engine.has_work:
        engine.step()
    assert ok.finish == "length" and _empty(models)


# -- streams ------------------------------------------------------------------------------------

def test_stream_closed_early_cancels_and_releases():
    engine, models = _engine()
    other = engine.add(_req("other", 8))
    stream = engine.stream(_req("s", 8, strategy="speculative", drafter="d", k=1))
    first = next(stream)
    assert first.token_ids and first.finish_reason is None
    assert "s" in _state(models)["target"] and "s" not in _state(models)["d"]     # the target-only first step
    assert next(stream).token_ids and "s" in _state(models)["d"]
    stream.close()
    assert "s" not in engine._live and all("s" not in ids for ids in _state(models).values())
    assert other.status == RUNNING and other.error is None              # the batch goes on
    engine.add(_req("s", 2))                                            # the id is free again
    while engine.has_work:
        engine.step()
    assert other.finish == "length" and len(other.generated) == 8 and _empty(models)


def test_stream_to_the_end_and_sink_delivery():
    engine, models = _engine()
    got = []
    seq = engine.add(_req("sink", 5, strategy="mag"), sink=got.append)
    chunks = list(engine.stream(_req("st", 5)))
    while engine.has_work:
        engine.step()
    for cs in (chunks, got):
        assert [t for c in cs for t in c.token_ids] == cs[-1].result.token_ids
        assert cs[-1].finish_reason == "length" and all(c.finish_reason is None for c in cs[:-1])
    assert seq.chunks == [] and _empty(models)


def test_on_end_is_called_once_for_every_outcome():
    engine, models = _engine(Limits(max_batch=2), bad=Failing("bad", V, seed=9, rng=Rng(1)))
    ended = []

    def add(rid, n, **opts):
        return engine.add(_req(rid, n, **opts), on_end=lambda s: ended.append((s.rid, s.finish, s.status)))
    for rid, n, opts in [("done", 1, {}), ("fail", 3, dict(strategy="speculative", drafter="bad", k=2)),
                         ("run", 9, {}), ("other", 4, {})]:
        add(rid, n, **opts)
    engine.step()                                       # done finishes, fail fails
    engine.step()                                       # run and other join
    queued = add("queued", 2)
    assert queued.status == WAITING
    engine.abort("run")                                 # one running, one waiting
    engine.abort("queued")
    while engine.has_work:
        engine.step()
    assert sorted(ended) == [("done", "length", FINISHED), ("fail", "error", FINISHED),
                             ("other", "length", FINISHED), ("queued", "cancelled", FINISHED),
                             ("run", "cancelled", FINISHED)]
    assert _empty(models)
