"""Planned steps are exact: a load-aware request whose planner switches between plain decoding (k = 0) and
speculation from step to step -- speculative, mag-style single drafters and the whole CS Drafting cascade --
still samples exactly the target's distribution (exact enumeration, V = 3, to 1e-9), alone and batched with a
second request that joins and leaves."""
from __future__ import annotations

import pytest

from cluster.core.sampling import SamplingParams
from cluster.engine.planner import is_planned
from cluster.engine.request import GenerationRequest
from tests.support.exact import (TabularModel, VocabTokenizer, enumerate_outcomes, join_and_leave, joint_of_two,
                                 local_engine, max_abs_diff, target_joint)


class Scripted:
    """A planner that plays a fixed list of draft lengths, one per plan, to every load-aware request that runs
    its strategy's step (as the real planner, it skips a request whose step is the target's alone: its first;
    a later one whose drafters hold no state yet is planned, and the engine prefills them when it drafts)."""

    def __init__(self, ks):
        self.ks, self.i = list(ks), 0

    def plan(self, running, stuck=None):
        planned = [s for s in running if is_planned(s) and not (stuck and stuck(s))]
        for s in planned:
            s.ctx.planned_k = self.ks[self.i % len(self.ks)]
        self.i += bool(planned)

    def observe(self, seconds):
        pass

    def prefilled(self, seqs, seconds=0.0):
        pass


OPTIONS = {"speculative": {"drafter": "large", "k": 2, "plan": "load_aware"},
           "cs_drafting": {"drafters": "large,small", "kmatrix": "1,1;0,2", "plan": "load_aware"}}


def _engine(ks, holder):
    target = TabularModel("target", 3, seed=21)
    large = TabularModel("large", 3, seed=22, zeros=True)
    small = TabularModel("small", 3, seed=23)
    engine = local_engine({"target": target, "large": large, "small": small}, VocabTokenizer(3),
                    rng_factory=lambda s: holder["rng"], planner=Scripted(ks))
    return engine, target, (large, small)


@pytest.mark.parametrize("strategy,ks", [("speculative", [0, 2, 0, 1]), ("speculative", [2, 0]),
                                         ("cs_drafting", [0, 1, 1, 0]), ("cs_drafting", [1, 0])])
def test_switching_between_plain_and_speculative_steps_is_exact(strategy, ks):
    holder = {}
    engine, target, drafters = _engine(ks, holder)

    def run(rng):
        holder["rng"] = rng
        engine.planner = Scripted(ks)               # every enumerated run plays the script from its start
        for d in drafters:
            d.rng = rng
        return tuple(engine.generate(GenerationRequest(
            prompt_ids=[0], max_new_tokens=4, sampling=SamplingParams(1.0), seed=0, strategy=strategy,
            options=OPTIONS[strategy])).token_ids)

    assert max_abs_diff(enumerate_outcomes(run), target_joint(target, [0], 4)) < 1e-9


B_ROWS = {"autoregressive": ("autoregressive", {}), "speculative": ("speculative", {"drafter": "small", "k": 2}),
          "planned": ("speculative", {"drafter": "small", "k": 2, "plan": "load_aware"})}


@pytest.mark.parametrize("strategy,b_strategy", [("speculative", "autoregressive"), ("cs_drafting", "autoregressive"),
                                                 ("speculative", "speculative"), ("speculative", "planned"),
                                                 ("cs_drafting", "planned")])
def test_planned_rows_batched_with_a_joining_and_leaving_request(strategy, b_strategy):
    """Request A (4 tokens) runs from the first step; B (3 tokens; plain autoregressive, or speculative with
    fixed k: its target-only first step runs beside A's planned step, its drafter is prefilled at the next; or
    planned too: its drafter is prefilled at the first step the plan has it draft) joins at the second step; the
    plan switches k every step.  The joint law of (A, B) is the
    product of the target's laws for their prompts."""
    holder = {}
    engine, target, drafters = _engine([0, 2, 1, 0, 2], holder)

    def run(rng):
        holder["rng"] = rng
        engine.planner = Scripted([0, 2, 1, 0, 2])
        for d in drafters:
            d.rng = rng
        b_name, b_options = B_ROWS[b_strategy]
        return join_and_leave(engine, dict(prompt_ids=[0], max_new_tokens=4, strategy=strategy,
                                           options=OPTIONS[strategy]),
                              dict(prompt_ids=[1], max_new_tokens=3, strategy=b_name, options=b_options), 1)

    assert max_abs_diff(enumerate_outcomes(run), joint_of_two(target, ([0], 4), ([1], 3))) < 1e-9
