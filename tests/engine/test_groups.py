"""Two groups (cluster.engine.groups): rows assigned as they join and rebalanced as they leave, one group stepping
per engine step while the far speculator drafts the other's next blocks from their committed sequences (``known``
entries); exact output laws by enumeration under batching with requests joining and leaving, greedy outputs equal
to plain decoding on tabular and real models, and the modelled decision of ``auto``."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import yaml

from cluster.config.schema import config_from_dict, load_config
from cluster.core.draft.cache import FanOut
from cluster.core.draft.near_far import LocalLink, NearFarSide
from cluster.core.draft.programs import DRAFTS
from cluster.core.draft.side import DraftSide
from cluster.core.draft.speculator import Speculator
from cluster.core.forward_cost import ForwardCost
from cluster.core.sampling import SamplingParams
from cluster.engine.groups import Groups, grouped_gain
from cluster.engine.planner import Planner
from cluster.engine.request import GenerationRequest
from cluster.engine.scheduler import Limits
from cluster.errors import ConfigError
from cluster.local import build_engine
from tests.support.exact import (
    TabularModel,
    VocabTokenizer,
    enumerate_outcomes,
    greedy_vs_plain,
    local_engine,
    max_abs_diff,
    target_joint,
)


def _rows(*rids):
    return [SimpleNamespace(rid=r) for r in rids]


def _ids(rows):
    return [r.rid for r in rows]


# -- assignment ------------------------------------------------------------------------------------
def test_rows_alternate_in_two_balanced_groups_and_rebalance_as_they_leave():
    g = Groups("on")
    rows = _rows("a", "b", "c", "d")
    now1, later1 = g.split(rows, True)
    now2, later2 = g.split(rows, True)
    assert sorted(_ids(now1 + later1)) == ["a", "b", "c", "d"] and len(now1) == len(later1) == 2
    assert _ids(now2) == _ids(later1) and _ids(later2) == _ids(now1)          # they take turns
    # two rows of one group leave: the latest joined row of the larger group moves over
    gone = set(_ids(now1))
    left = [r for r in rows if r.rid not in gone] + _rows("e")
    now3, later3 = g.split(left, True)
    assert abs(len(now3) - len(later3)) <= 1 and sorted(_ids(now3 + later3)) == sorted(_ids(left))
    sizes = [sum(1 for r in left if g.group_of(r.rid) == i) for i in (0, 1)]
    assert sorted(sizes) == [1, 2]


def test_one_row_or_grouping_off_steps_every_row_and_fresh_rows_step_at_once():
    g = Groups("on")
    assert g.split(_rows("a"), True)[1] == []          # the second group is empty: the only row steps
    rows = _rows("a", "b", "c")
    now, later = g.split(rows, False)
    assert _ids(now) == ["a", "b", "c"] and later == []
    now, later = g.split(rows + _rows("x"), True, fresh=_rows("x")[:0])
    fresh = [SimpleNamespace(rid="y")]
    now, later = g.split(rows + fresh, True, fresh=fresh)
    assert "y" in _ids(now) and "y" not in _ids(later)
    with pytest.raises(ValueError, match="mode"):
        Groups("sometimes")


def test_the_cost_tables_model_the_gain_of_hiding_the_drafting():
    """A target whose verification costs its rows' tokens (compute bound) and a drafter whose k forwards cost as
    much: two groups hide the drafting and model 2x; a free drafter gives them nothing."""
    target = ForwardCost({(r, t): 1e-3 * r * t for r in (1, 2, 4, 8, 16, 32) for t in (1, 2, 3, 4, 5)})
    drafter = ForwardCost({(r, 1): 1e-3 * r * 5 / 4 for r in (1, 2, 4, 8, 16, 32)})
    assert grouped_gain({"t": target, "d": drafter}, "t", "d", 32, 4, 0.8) == pytest.approx(2.0)
    assert grouped_gain({"t": target}, "t", "d", 32, 4, 0.8) == pytest.approx(1.0)
    assert grouped_gain({"t": target, "d": drafter}, "t", "d", 1, 4, 0.8) == 0.0
    planner = SimpleNamespace(costs={"t": target}, target="t", alpha=lambda d: 0.8)
    g = Groups("auto")
    assert not any(g.pays(16, SimpleNamespace(drafts_ahead=True), planner, _drafting(16)) for _ in range(50))
    assert g.bands["d", 4].ruled_out                        # a free drafter: never tried


def _drafting(n):
    return [SimpleNamespace(rid=f"r{i}", generated=[], req=SimpleNamespace(strategy=SimpleNamespace(k=4, drafter="d")))
            for i in range(n)]


def _drive(g: Groups, rows, steps: int, cost) -> list[bool]:
    """``steps`` engine steps of ``rows`` under ``g``; ``cost(grouped, n)`` -> (tokens per row, seconds) of a step
    of n rows.  -> the arm of each step."""
    side, t, arms = SimpleNamespace(drafts_ahead=True), 0.0, []
    for _ in range(steps):
        g.observe(t)
        grouped = g.pays(len(rows), side, None, rows)
        now, _ = g.split(rows, grouped, now=t)
        per_row, seconds = cost(grouped, len(now))
        for s in now:
            s.generated += [0] * per_row
        t += seconds
        arms.append(grouped)
    return arms


def test_auto_tries_both_arms_per_band_and_keeps_the_faster():
    """Measured goodput decides: where two groups step twice the tokens per second they stay on (the one-group arm
    retried ever more rarely); where they are slower, off after one trial."""
    rows = _drafting(16)
    fast = _drive(Groups("auto"), rows, 400, lambda grouped, n: (4, 0.01 * n / 8) if grouped else (3, 0.03))
    assert not any(fast[:12]) and all(fast[12:24])            # one group first, then a trial of two
    assert sum(fast[24:]) > 0.9 * len(fast[24:])              # kept on; one group retried now and then
    g = Groups("auto")
    slow = _drive(g, rows, 400, lambda grouped, n: (4, 0.04 * n / 8) if grouped else (3, 0.03))
    assert all(slow[12:24]) and not any(slow[24:24 + 256 - 30])
    assert g.bands["d", 4].best is False and sum(slow) <= 3 * 12
    assert g.bands["d", 4].interval > 256                          # it lost again: tried more rarely
    mode_on = _drive(Groups("on"), _drafting(16), 5, lambda grouped, n: (1, 0.01))
    assert all(mode_on) and not any(_drive(Groups("off"), _drafting(16), 5, lambda grouped, n: (1, 0.01)))
    plain = [SimpleNamespace(rid="a", generated=[], req=SimpleNamespace(strategy=SimpleNamespace()))] * 16
    assert not Groups("on").pays(16, SimpleNamespace(drafts_ahead=True), None, plain)    # autoregressive rows
    assert not Groups("on").pays(16, SimpleNamespace(drafts_ahead=False), None, rows)    # nothing drafts ahead


# -- exact laws ------------------------------------------------------------------------------------
def _side(drafters: dict, copies: dict, rng=None):
    kw = {} if rng is None else dict(rng_factory=lambda s: rng)
    return NearFarSide(DraftSide(drafters, **kw), LocalLink(Speculator(copies, **kw)), fanout=FanOut(rows=2),
                       sampled=True, max_rows=8)


def _req(rid, prompt, n, sampling, k=1):
    return GenerationRequest(prompt_ids=prompt, max_new_tokens=n, sampling=sampling, seed=1, strategy="speculative",
                             options={"drafter": "d", "k": k}, request_id=rid)


def test_two_groups_keep_the_target_law_with_rows_joining_and_leaving():
    """A sampled request decoded in two groups with greedy ones that join mid-run and leave early (the groups
    rebalance): every draw enumerated, the speculator's included; the sampled request's first three tokens follow
    the target exactly, the greedy ones are the target's argmax paths, and blocks drafted ahead are used."""
    target, d = TabularModel("target", 3, seed=21), TabularModel("d", 3, seed=22, zeros=True)
    copy = TabularModel("d", 3, seed=22, zeros=True)
    sampling, greedy = SamplingParams(1.0), SamplingParams(0.0)
    plain = local_engine({"target": TabularModel("target", 3, seed=21)}, VocabTokenizer(3))
    want = {tuple(p): plain.generate(GenerationRequest(prompt_ids=p, max_new_tokens=n, sampling=greedy, seed=0,
                                                strategy="autoregressive")).token_ids
            for p, n in (([2, 1], 2), ([1], 6), ([0, 2], 3))}
    engines = []

    def run(rng):
        d.rng = copy.rng = rng
        engine = local_engine({"target": target, "d": d, DRAFTS: _side({"d": d}, {"d": copy}, rng)},
                              VocabTokenizer(3), rng_factory=lambda s: rng, groups="on")
        engines.append(engine)
        seqs = [engine.add(_req("s", [0], 5, sampling)), engine.add(_req("g0", [2, 1], 2, greedy))]
        engine.step()
        seqs += [engine.add(_req("g1", [1], 6, greedy)), engine.add(_req("g2", [0, 2], 3, greedy))]
        while engine.has_work:
            engine.step()
        for seq, p in zip(seqs[1:], ([2, 1], [1], [0, 2])):
            assert seq.generated == want[tuple(p)]
        return tuple(seqs[0].generated[:3])

    got = enumerate_outcomes(run)
    assert max_abs_diff(got, target_joint(target, [0], 3, sampling)) < 1e-9
    assert all(e.groups.grouped_steps > 0 for e in engines)
    assert sum(e.models[DRAFTS].counters.hits["known"] for e in engines) > 0
    assert not target.seqs and not d.seqs


@pytest.mark.parametrize("seed_d", [9, 40])
def test_greedy_outputs_in_two_groups_equal_plain_decoding(seed_d):
    """Eight greedy requests of different lengths through a batch of four (joining as others leave): outputs
    equal the target's; with a drafter equal to the target every block drafted ahead in time is a ``known`` hit."""
    target, d = TabularModel("target", 5, seed=9), TabularModel("d", 5, seed=seed_d)
    side = _side({"d": d}, {"d": TabularModel("d", 5, seed=seed_d)})
    engine = local_engine({"target": target, "d": d, DRAFTS: side}, VocabTokenizer(5), groups="on",
                          limits=Limits(max_batch=4))
    plain = local_engine({"target": TabularModel("target", 5, seed=9)}, VocabTokenizer(5))
    prompts = [[1, 2], [3], [4, 0, 1], [2], [0, 0], [1, 3, 4], [2, 2], [4]]
    reqs = [dict(prompt_ids=p, max_new_tokens=8 + 5 * i, sampling=SamplingParams(0.0), seed=0, request_id=f"r{i}")
            for i, p in enumerate(prompts)]
    got, want = greedy_vs_plain(engine, plain, reqs, {"drafter": "d", "k": 4})
    assert got == want
    c = side.counters
    assert engine.groups.grouped_steps > 0 and c.hits["known"] > 0 and c.late == 0
    if seed_d == 9:                                     # the drafter is the target: only the first steps miss
        assert c.hits["known"] + c.hits["bonus"] + c.hits["reject"] >= c.steps - 3 * len(reqs)
    assert not side.active_requests() and not side.link.speculator.active_requests()


def test_real_models_in_two_groups_equal_autoregressive(tiny_engine):
    """configs/tiny.yaml in-process with the speculator topology's near-far side (a LocalLink): greedy outputs of
    every drafting strategy, batched, in two groups, equal autoregressive's."""
    cfg = load_config("configs/tiny.yaml")
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, groups="on"))
    engine = build_engine(cfg, speculator=True)
    prompts = [list(b"import os\nimport sys\n"), list(b"def main():\n    return 1\n"), list(b"class A:\n"),
               list(b"x = [1, 2, 3]\n")]

    def run(eng, strategy):
        return [r.token_ids for r in eng.generate_many([
            GenerationRequest(prompt_ids=p, max_new_tokens=24 + 4 * i, sampling=SamplingParams(0.0), seed=3,
                              strategy=strategy, ignore_eos=True, request_id=f"{strategy}-{i}")
            for i, p in enumerate(prompts)])]
    want = run(tiny_engine, "autoregressive")
    for strategy in ("speculative", "cs_drafting"):
        assert run(engine, strategy) == want, strategy
    assert engine.groups.grouped_steps > 0 and engine.models[DRAFTS].counters.hits["known"] > 0


def test_the_planner_keeps_the_resting_groups_acceptance_live():
    """Load-aware requests in two groups: the group that does not step is passed to the planner as resting, so its
    acceptance counts are not folded into the drafter's totals (and counted again) every other step."""
    target, d = TabularModel("target", 5, seed=9), TabularModel("d", 5, seed=40)
    side = _side({"d": d}, {"d": TabularModel("d", 5, seed=40)})
    costs = {"target": ForwardCost({(r, t): 1e-3 * t for r in (1, 32) for t in (1, 5)})}
    planner = Planner(costs, "target")
    engine = local_engine({"target": target, "d": d, DRAFTS: side}, VocabTokenizer(5), groups="on", planner=planner)
    plain = local_engine({"target": TabularModel("target", 5, seed=9)}, VocabTokenizer(5))
    reqs = [dict(prompt_ids=p, max_new_tokens=24, sampling=SamplingParams(0.0), seed=0, request_id=f"r{i}")
            for i, p in enumerate(([1, 2], [3], [4, 0, 1], [2]))]
    seen = []
    retire = planner.acceptance.retire
    planner.acceptance.retire = lambda live: (seen.append(sum(k not in live for k in planner.acceptance._tracks)),
                                              retire(live))
    got, want = greedy_vs_plain(engine, plain, reqs, {"drafter": "d", "k": 4, "plan": "load_aware"})
    assert got == want and engine.groups.grouped_steps > 0
    assert sum(seen) <= len(reqs)                      # each request retired at most once: when it left


@pytest.mark.parametrize("value,want", [("auto", "auto"), ("on", "on"), ("off", "off"), (True, "on"), (False, "off"),
                                        ("sometimes", None), (2, None)])
def test_engine_groups_is_validated_in_the_config(value, want):
    """``engine.groups`` takes auto | on | off (a bare YAML on / off, read as a boolean, means the same) and a bad
    value is a one-line error naming the key, the choices and the value."""
    data = yaml.safe_load(open("configs/tiny.yaml"))
    data["engine"] = {**data.get("engine", {}), "groups": value}
    if want is not None:
        assert config_from_dict(data).engine.groups == want
        return
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert "engine.groups" in str(e.value) and str(value) in str(e.value)
    assert "auto, on, off" in str(e.value) or "expected str" in str(e.value)
