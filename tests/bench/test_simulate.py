"""The served-step simulation (cluster.bench.simulate): literal cases whose answers follow from the inputs."""
import argparse
import json
from dataclasses import replace

import pytest

from cluster.bench import SUITES
from cluster.bench.simulate import Strategy, Unit, simulate
from cluster.bench.projection import believed
from cluster.bench.simulate_suite import load_measured
from cluster.config.schema import load_config
from cluster.errors import ParamError
from cluster.family import ensure_built
from cluster.core.forward_cost import ForwardCost

TARGET = ForwardCost({(1, 1): 0.004, (1, 5): 0.005, (16, 1): 0.008, (16, 5): 0.012})
DRAFTER = ForwardCost({(1, 1): 0.001, (16, 1): 0.002})


def test_autoregressive_at_one_client_is_one_token_per_target_forward():
    res = simulate(Unit(TARGET), Strategy("autoregressive"), clients=1, requests=3, new_tokens=50)
    assert res.tok_s == pytest.approx(1 / 0.004, rel=1e-12)
    assert res.steps == 150 and res.step_ms == pytest.approx(4.0)


def test_full_acceptance_with_free_drafting_gives_k_plus_one_tokens_per_step():
    for k in (1, 4, 7):
        res = simulate(Unit(TARGET), Strategy("mag", k=k, alpha=1.0), clients=1, requests=2, new_tokens=8 * (k + 1))
        assert res.tokens_per_row_step == pytest.approx(k + 1)
        assert res.steps == 16
        assert res.tok_s == pytest.approx((k + 1) / TARGET(1, k + 1))


def test_replayed_histogram_of_all_rejections_is_one_token_per_step():
    res = simulate(Unit(TARGET), Strategy("s", k=4, drafter=DRAFTER, accepted=(1.0, 0, 0, 0, 0)), 1, 1, 20)
    assert res.steps == 20 and res.tok_s == pytest.approx(1 / (4 * 0.001 + 0.005))


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.9, 1.0])
@pytest.mark.parametrize("clients", [1, 4, 16])
@pytest.mark.parametrize("rtt", [0.0, 0.002])
def test_predrafting_is_never_slower_than_synchronous(alpha, clients, rtt):
    common = dict(k=4, drafter=DRAFTER, alpha=alpha, separated=True, rtt=rtt)
    sync = simulate(Unit(TARGET), Strategy("sync", **common), clients, 2 * clients, 64, seed=3)
    pre = simulate(Unit(TARGET), Strategy("pre", predraft=True, **common), clients, 2 * clients, 64, seed=3)
    assert pre.tokens == sync.tokens
    assert pre.seconds <= sync.seconds * (1 + 1e-12)
    if alpha == 1.0 and clients <= 8:   # every bet comes true: after the first step no row drafts on the path
        assert pre.hit_rate > 0.9 and pre.seconds < sync.seconds
    if alpha == 0.0:
        assert pre.hits == 0


def test_a_speculator_in_time_takes_drafting_off_every_step_but_the_first_and_a_late_one_is_raced_or_none():
    """Every bet right (alpha 1): the first step drafts near (4 x 1 ms) and verifies (5 ms) while the speculator's
    fill (5 rounds of 1 ms) is answered by its end; every later step takes its block from the cache and is answered
    from the look-ahead.  A speculator twice as slow as the verification lands while near drafts: raced, near
    stops at its next round.  One whose answers take 20 ms to travel never lands in time: near drafting's speed."""
    fast = Strategy("s", k=4, drafter=DRAFTER, alpha=1.0, speculator=True)
    res = simulate(Unit(TARGET), fast, 1, 1, 50)
    assert (res.steps, res.hits) == (10, 9) and res.seconds == pytest.approx(0.009 + 9 * 0.005)
    slow_drafter = ForwardCost({(1, 1): 0.002, (16, 1): 0.004})
    late = simulate(Unit(TARGET), Strategy("s", k=4, drafter=slow_drafter, alpha=1.0, speculator=True), 1, 1, 50)
    near = simulate(Unit(TARGET), Strategy("s", k=4, drafter=slow_drafter, alpha=1.0), 1, 1, 50)
    assert near.seconds == pytest.approx(10 * 0.013) and late.hits == 9
    assert late.step_seconds[1] == pytest.approx(0.011) and late.seconds < near.seconds   # 3 near rounds, then 2
    far = simulate(Unit(TARGET), replace(fast, rtt=0.04), 1, 1, 50)
    assert far.hits == 0 and far.seconds == pytest.approx(10 * 0.009)


def test_a_speculators_bets_come_true_at_its_hit_rate_and_only_steps_of_its_rows_are_speculated():
    """``hit_rate`` decides the bets, not the accepted counts: with every draft rejected and a hit rate of 1 every
    step after the first takes its block (5 ms steps), with 0 none (near drafts: 9 ms).  Steps of more rows than
    ``predraft_rows`` send no fill: two clients then cost exactly near drafting."""
    s = Strategy("s", k=4, drafter=DRAFTER, accepted=(1.0, 0, 0, 0, 0), speculator=True, hit_rate=1.0)
    res = simulate(Unit(TARGET), s, 1, 1, 10)
    assert (res.steps, res.hits) == (10, 9) and res.seconds == pytest.approx(0.009 + 9 * 0.005)
    none = simulate(Unit(TARGET), replace(s, hit_rate=0.0), 1, 1, 10)
    assert none.hits == 0 and none.seconds == pytest.approx(10 * 0.009)
    two = simulate(Unit(TARGET), replace(s, predraft_rows=1), 2, 2, 10)
    near = simulate(Unit(TARGET), replace(s, speculator=False), 2, 2, 10)
    assert two.hits == 0 and two.seconds == pytest.approx(near.seconds)
    assert simulate(Unit(TARGET), replace(s, predraft_rows=2), 2, 2, 10).hits > 0


def test_from_plain_from_rows_up_a_step_decodes_plainly():
    """``plain_from`` 2: one client speculates; 16 clients decode as autoregressive decoding does, to the tick."""
    s = Strategy("s", k=4, drafter=DRAFTER, alpha=0.7, plain_from=2)
    one = simulate(Unit(TARGET), s, 1, 2, 40, seed=1)
    assert one.tokens_per_row_step > 1.5 and one.seconds < simulate(Unit(TARGET), Strategy("ar"), 1, 2, 40).seconds
    many, ar = (simulate(Unit(TARGET), x, 16, 16, 40, seed=1) for x in (s, Strategy("ar")))
    assert (many.steps, many.seconds) == (ar.steps, pytest.approx(ar.seconds))


@pytest.mark.parametrize("clients", [1, 2, 5, 16, 32])
def test_c_clients_of_one_request_each_finish_c_times_n_tokens(clients):
    for s in (Strategy("autoregressive"), Strategy("s", k=4, drafter=DRAFTER, alpha=0.7, separated=True,
                                                   rtt=0.001, predraft=True)):
        res = simulate(Unit(TARGET, max_batch=16), s, clients, clients, 40, seed=2)
        assert (res.requests, res.tokens) == (clients, clients * 40)


@pytest.mark.parametrize("clients", [1, 3, 8, 20])
def test_every_client_finishes_its_requests(clients):
    unit = Unit(TARGET, prefill=lambda rows: 0.001 * rows, front_request=0.002, max_batch=8)
    res = simulate(unit, Strategy("s", k=4, drafter=DRAFTER, alpha=0.6), clients, 2 * clients, 33, seed=1)
    assert res.requests == 2 * clients and res.tokens == 2 * clients * 33
    assert res.row_steps <= 8 * res.steps


def test_batching_beats_one_client_and_a_full_batch_is_capped():
    one = simulate(Unit(TARGET), Strategy("autoregressive"), 1, 4, 32)
    many = simulate(Unit(TARGET), Strategy("autoregressive"), 16, 16, 32)
    assert many.tok_s == pytest.approx(16 / 0.008)          # 16 rows per 8 ms forward
    assert many.tok_s > 7 * one.tok_s
    capped = simulate(Unit(TARGET, max_batch=4), Strategy("autoregressive"), 16, 16, 32)
    assert capped.row_steps == 4 * capped.steps


def test_the_same_seed_gives_the_same_cell_and_another_seed_another():
    s = Strategy("s", k=4, drafter=DRAFTER, alpha=0.6, separated=True, rtt=0.001, predraft=True)
    a, b = (simulate(Unit(TARGET), s, 4, 12, 64, seed=7) for _ in range(2))
    assert (a.tokens, a.seconds, a.steps, a.hits) == (b.tokens, b.seconds, b.steps, b.hits)
    c = simulate(Unit(TARGET), s, 4, 12, 64, seed=8)
    assert (c.seconds, c.steps) != (a.seconds, a.steps)


def test_the_front_and_the_round_trip_cost_what_they_say():
    s = Strategy("mag", k=4, alpha=0.0, separated=True, rtt=0.002)
    res = simulate(Unit(TARGET, front_request=0.01), s, 1, 1, 10)
    assert res.seconds == pytest.approx(0.01 + 10 * (0.002 + TARGET(1, 5)))


def test_the_served_step_costs_its_part_per_step_and_per_token():
    unit = Unit(TARGET, served_step=0.001, served_token=0.0005)
    ar = simulate(unit, Strategy("autoregressive"), 1, 1, 10)
    assert ar.seconds == pytest.approx(10 * (TARGET(1, 1) + 0.001 + 0.0005))
    full = simulate(unit, Strategy("mag", k=4, alpha=1.0), 1, 1, 10)       # two steps of 5 tokens
    assert full.steps == 2 and full.seconds == pytest.approx(2 * (TARGET(1, 5) + 0.001 + 5 * 0.0005))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="clients"):
        simulate(Unit(TARGET), Strategy("x"), 0, 1, 1)


def _cell(topology, strategy, c, tok_s, ratio):
    return dict(topology=topology, mode="unary", strategy=strategy, concurrency=c, requests=max(2 * c, 2),
                tok_s=tok_s, vs_autoregressive=ratio)


def test_the_suite_fits_the_served_step_on_autoregressive_and_checks_every_other_cell(tmp_path, capsys):
    cfg = load_config("configs/tiny.yaml")
    ensure_built(cfg, progress=False)
    # 20 tok/s per client, 0.9x linear at two: the served step's fit has room both ways (exactly linear would need
    # a batch-2 forward no dearer than a batch-1 one, which the measured forward costs here need not be)
    measured = [_cell(t, s, c, 20.0 * c * (0.9 if c == 2 else 1.0) * (1.3 if s == "default" else 1.0),
                      1.3 if s == "default" else 1.0)
                for t in ("separated", "colocated") for c in (1, 2) for s in ("autoregressive", "default")]
    measured.append(dict(topology="separated", mode="streamed", strategy="default", concurrency=1, tok_s=1.0))
    measured += [_cell("speculator", "autoregressive", 1, 20.0, 1.0),
                 dict(_cell("speculator", "default", 1, 26.0, 1.3), cache_hit_share=0.5)]
    path = tmp_path / "bench_served.json"
    path.write_text(json.dumps(measured))
    args = argparse.Namespace(prompts="2", max_new_tokens="8", temperature="0", out=str(tmp_path), measured=str(path))
    assert SUITES["simulate"](args, cfg) == 0
    table = json.loads((tmp_path / "simulate_calibration.json").read_text())
    assert len(table) == 10                                  # the unary cells only
    far = next(r for r in table if r["topology"] == "speculator" and r["strategy"] == "default")
    assert far["measured_cache_hits"] == 0.5 and 0 <= far["sim_predraft_hits"] <= 1
    for r in table:
        fitted = r["strategy"] == "autoregressive"          # at c = 1 and at the largest c, here 2
        assert r["tok_s_within_10pct"] == ("fitted" if fitted else "yes" if abs(r["tok_s_error_pct"]) <= 10 else "NO")
        assert r["ratio_within_10pct"] == ("reference" if fitted
                                           else "yes" if abs(r["ratio_error_pct"]) <= 10 else "NO")
        if fitted:       # 20 tok/s per client is far slower than tiny models: the served step absorbs it
            assert r["simulated_tok_s"] == pytest.approx(20.0 * r["c"] * (0.9 if r["c"] == 2 else 1.0), rel=0.01)
            assert r["served_ms_per_step"] > 0 and r["served_ms_per_token"] >= 0
    projection = json.loads((tmp_path / "simulate_projection.json").read_text())
    assert {r["batch"] for r in projection} == {1, 4, 16, 32}
    drafting = [r for r in table if r["ratio_within_10pct"] in ("yes", "NO")]
    within = sum(r["ratio_within_10pct"] == "yes" for r in drafting)
    assert believed(within, len(drafting)) in capsys.readouterr().out      # the projection says what it is worth
    inputs = json.loads((tmp_path / "simulate_inputs.json").read_text())
    assert any(r["what"].startswith("target forward, 1 rows x 5 tokens") and r["ms"] > 0 for r in inputs)
    # the cache's share of steps with every answer in time, measured in-process for the speculator's cells
    assert 0 <= next(r["cache_hits_in_time"] for r in inputs if r["what"].startswith("default:")) <= 1


def test_a_measured_table_without_its_reference_cell_is_refused(tmp_path):
    path = tmp_path / "bench_served.json"
    path.write_text(json.dumps([_cell("separated", "default", 4, 10.0, 1.0)]))
    with pytest.raises(ParamError, match="measured"):
        load_measured(path)
    with pytest.raises(ParamError, match="measured"):
        load_measured(tmp_path / "missing.json")


def test_without_a_measured_table_the_cells_are_simulated_unchecked(tmp_path, capsys):
    cfg = load_config("configs/tiny.yaml")
    ensure_built(cfg, progress=False)
    args = argparse.Namespace(prompts="2", max_new_tokens="6", temperature="0", out=str(tmp_path), measured=None,
                              concurrency="1,2")
    assert SUITES["simulate"](args, cfg) == 0
    printed = capsys.readouterr().out
    assert "no --measured served table" in printed and believed() in printed
    table = json.loads((tmp_path / "simulate_calibration.json").read_text())
    strategies = {r["strategy"] for r in table}
    assert "autoregressive" in strategies and "default" in strategies      # tiny serves no Max-Gram drafter
    assert {(r["topology"], r["c"]) for r in table} == {(t, c) for t in ("separated", "colocated") for c in (1, 2)}
    assert all(r["ratio_within_10pct"] == "unchecked" and r["simulated_tok_s"] > 0 for r in table)


def test_inputs_are_scaled_to_the_machines_speed_during_the_served_run():
    """A served run whose own in-process autoregressive cell read half this suite's tok/s ran on a machine twice
    as slow: every in-process cost (the target, prefill, the drafter, the engine's work) is simulated twice as
    dear; without that cell, as measured."""
    from cluster.bench.simulate_inputs import Inputs, Measured
    ar = Measured("autoregressive", "autoregressive", {}, alone_tok_s=200.0, overhead=((1.0, 0.001),))
    spec = Measured("default", "speculative", {"k": 4}, k=4, drafter="d", overhead=((1.0, 0.002),))
    inp = Inputs(TARGET, TARGET, {"d": (DRAFTER, TARGET)}, [ar, spec], 8, 32)
    inp.at_speed(None)
    assert inp.speed == 1.0 and inp.unit().target(1, 5) == pytest.approx(0.005)
    inp.at_speed(100.0)
    s = inp.strategy(spec, "colocated")
    assert inp.speed == 2.0 and inp.unit().target(1, 5) == pytest.approx(0.010)
    assert s.drafter(1, 1) == pytest.approx(0.002) and s.overhead(1) == pytest.approx(0.004)
    assert s.plain_overhead(1) == pytest.approx(0.002) and inp.unit().prefill(1) == pytest.approx(2 * TARGET(1, 8))


def test_the_separated_draft_call_costs_what_its_channel_measured():
    """The separated step's round trip beyond the actor's compute follows ``cluster.draft_channel`` (a Ray call or
    the socket, each as measured hop by hop), or the served suite's ``separated+<channel>`` label where it names one."""
    from cluster.bench.simulate_inputs import RTT_S, Inputs, Measured
    spec = Measured("default", "speculative", {"k": 4}, k=4, drafter="d", draft="neural", overhead=((1.0, 0.002),))
    mag = Measured("mag", "mag", {"k": 3}, k=3, draft="free", overhead=((1.0, 0.001),))
    inp = Inputs(TARGET, TARGET, {"d": (DRAFTER, TARGET)}, [spec, mag], 8, 32, channel="socket")
    assert RTT_S["socket"]["neural"] < RTT_S["ray"]["neural"] and RTT_S["socket"]["mag"] < RTT_S["ray"]["mag"]
    assert inp.strategy(spec, "separated").rtt == RTT_S["socket"]["neural"]
    assert inp.strategy(mag, "separated").rtt == RTT_S["socket"]["mag"]
    assert inp.strategy(spec, "separated+ray").rtt == RTT_S["ray"]["neural"]
    assert inp.strategy(spec, "separated+ray").separated and inp.unit(topology="separated+ray").shared_core
    assert inp.strategy(spec, "colocated").rtt == 0.0
    # the served run's own hops at 2 clients, where it measured them: a miss's compute less the drafter's forwards
    # is the actor's own work
    s = inp.strategy(spec, "separated", call=(0.006, 0.0004), rows=2)
    assert s.rtt == 0.0004 and s.side_work == pytest.approx(0.006 - 4 * DRAFTER(2, 1))
    s = inp.strategy(mag, "separated", call=(0.0016, 0.0003), rows=2)     # Max-Gram's lookups: on top of it
    assert s.rtt == 0.0003 and s.side_work == 0.0016
    cascade = Measured("cs_drafting", "cs_drafting", {}, k=4, draft="cascade", overhead=((1.0, 0.005),))
    assert inp.strategy(cascade, "separated", call=(0.004, 0.0005), rows=1).side_work == 0.0   # replaces it
    assert inp.strategy(spec, "colocated", call=(0.006, 0.0004), rows=2).rtt == 0.0


def test_a_rows_engine_work_is_spread_over_every_step_after_the_prompt_plain_ones_too(monkeypatch):
    """A load-aware request that drafted on 10 of its 32 steps (the planner chose k = 0 on the rest; ``stats.steps``
    counts only the 10) took 0.1 s: 0.1 / 32 s a step, not 0.1 / 10 -- which read 0.7 s a step for 16 plain rows."""
    import cluster.bench.simulate_inputs as si
    clock = [0.0]
    monkeypatch.setattr(si.time, "perf_counter", lambda: clock[0])

    class Stats:
        steps, target_forwards = 10, 33                  # the prompt's forward + 10 drafting + 22 plain steps
        accepted_hist, drafted_tokens, accepted_tokens = [4, 2, 1, 1, 2], 40, 14

    class Engine:
        def generate(self, req):
            clock[0] += 0.1 if req.max_new_tokens == 64 else 0.0       # the untimed warm-up costs nothing
            return type("Result", (), {"stats": Stats, "token_ids": [1] * req.max_new_tokens})()

    zero = ForwardCost({(1, 1): 0.0, (16, 1): 0.0})
    inp = si.Inputs(TARGET, zero, {}, [], 8, 32)
    m = si.measure_strategy(Engine(), inp, si.Measured("la", "mag", {"k": 4, "plan": "load_aware"}, k=4),
                            [[5] * 8, [6] * 8], 64, ())
    assert m.step_ms == {1.0: pytest.approx(1e3 * 0.1 / 32)}
    assert m.overhead[0][1] == pytest.approx(0.1 / 32 - TARGET(1, 5))
    assert m.accepted == tuple(h / 10 for h in Stats.accepted_hist) and m.alpha == 14 / 40


def test_the_projection_is_believed_only_when_every_drafting_ratio_was_within_10_percent():
    assert believed(72, 72).startswith("calibrated: all 72")
    assert believed(47, 72).startswith("NOT calibrated: 47 of 72") and "not a forecast" in believed(47, 72)
    assert believed(0, 0).startswith("NOT calibrated") and believed().startswith("unchecked")


def test_what_drafts_is_read_from_the_strategys_draft_spec_not_its_name():
    """The simulator prices a row's drafting (far in the speculator topology; the actor's lookups on top of the
    engine's work where separated) by what its strategy's draft program is made of."""
    from types import SimpleNamespace
    from cluster.bench.simulate_inputs import Inputs, Measured, draft_kind
    handle = lambda deterministic: SimpleNamespace(deterministic=deterministic, proposes=True, max_length=64)
    engine = SimpleNamespace(models={"t": handle(False), "big": handle(False), "small": handle(False),
                                     "mg": handle(True)})
    assert draft_kind(engine, "t", "speculative", {"drafter": "big"}) == "neural"
    assert draft_kind(engine, "t", "mag", {}) == "free"                    # found by capability, not by name
    assert draft_kind(engine, "t", "cs_drafting", {"drafters": "big,mg"}) == "cascade"
    assert draft_kind(engine, "t", "autoregressive", {}) is None
    inp = Inputs(TARGET, TARGET, {"big": (DRAFTER, TARGET)}, [], 8, 32)
    far = [inp.drafted_far(Measured(n, s, {}, k=4, drafter="big", draft=d))
           for n, s, d in (("default", "speculative", "neural"), ("cs", "cs_drafting", "cascade"))]
    assert far == [True, False]
