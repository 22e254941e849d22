"""build_planner, the one place both roots get the engine's planner from: forward costs measured through the
handle protocol (batched or single-request forms), measured now or on first use, and always attached."""
from types import SimpleNamespace

from cluster.config.schema import load_config
from cluster.core.interfaces import PerRequestHandle
from cluster.core.forward_cost import ForwardCost, step_seconds
from cluster.core.draft.programs import DRAFTS
from cluster.core.sampling import SamplingParams
from cluster.engine.measure import build_planner, forward_cost_grid, measure_costs, planner_rows
from cluster.engine.request import GenerationRequest
from cluster.family import ensure_built
from cluster.local import build_engine


class SingleFormHandle(PerRequestHandle):
    """A handle written in per-request forms (batched by the one adapter): the measurement drives it."""

    def __init__(self, name="m", deterministic=False):
        self.name, self.vocab_size, self.max_length, self.deterministic = name, 16, 64, deterministic
        self.live: dict[str, int] = {}
        self.scored = 0

    def prefill(self, rid, ids, sampling, seed):
        self.live[rid] = len(ids)

    def score(self, rid, draft):
        assert rid in self.live
        self.scored += 1

    def rollback(self, rid, length):
        self.live[rid] = length

    def extend(self, rid, ids):
        self.live[rid] += len(ids)

    def release(self, rid):
        self.live.pop(rid, None)


def test_grid_through_single_request_forms_releases_its_rows():
    h = SingleFormHandle()
    grid = forward_cost_grid(h, rows=(1, 3), new_tokens=(1, 2), context=8, iters=2)
    assert set(grid) == {(1, 1), (1, 2), (3, 1), (3, 2)} and all(v >= 0 for v in grid.values())
    assert h.scored == (1 + 3) * 2 * 3 and h.live == {}            # 2 iterations + 1 warm-up per cell


def test_measure_costs_skips_deterministic_drafters_and_caps_rows():
    handles = {"t": SingleFormHandle("t"), "d": SingleFormHandle("d"), "mag": SingleFormHandle("mag", True)}
    costs = measure_costs(handles, "t", ["d", "mag"], rows=(1, 2), new_tokens=(1, 3), iters=1)
    assert set(costs) == {"t", "d"}                                 # the Max-Gram drafter drafts for free
    assert costs["t"].rows == [1, 2] and costs["t"].tokens == [1, 3] and costs["d"].tokens == [1]
    assert planner_rows(4) == (1, 2, 4) and planner_rows(12) == (1, 2, 4, 8, 12)
    assert planner_rows(4096) == (1, 2, 4, 8, 16, 32) and planner_rows(1) == (1,)


def test_build_planner_measures_now_only_when_the_config_asks():
    handles = {"t": SingleFormHandle("t"), "d": SingleFormHandle("d")}
    lazy = build_planner(handles, "t", ["d"], SimpleNamespace(max_batch=2, options={}), iters=1)
    assert lazy.costs == {} and handles["t"].scored == 0           # nothing measured yet ...
    stats = SimpleNamespace(steps=0, accepted_tokens=0, drafted_tokens=0, generated_tokens=0)
    seq = SimpleNamespace(req=SimpleNamespace(strategy=SimpleNamespace(load_aware=True, drafter="d", k=4)),
                          ctx=SimpleNamespace(stats=stats, planned_k=None))
    lazy.plan([seq])
    assert set(lazy.costs) == {"t", "d"} and seq.ctx.planned_k is not None    # ... until a step plans
    assert lazy.costs["t"].rows == [1, 2]                           # rows up to engine.max_batch
    eager = build_planner(handles, "t", ["d"], SimpleNamespace(max_batch=2, options={"plan": "load_aware"}),
                          iters=1)
    assert set(eager.costs) == {"t", "d"}


def test_every_engine_has_the_planner_and_a_per_request_load_aware_plan_runs_on_it():
    """configs/tiny.yaml does not ask for the planner: the engine still has one, measured on first use, so
    ``plan=load_aware`` is honoured (never a silent fixed k); greedy output stays the target's."""
    cfg = load_config("configs/tiny.yaml")
    ensure_built(cfg, progress=False)
    engine = build_engine(cfg)
    assert engine.planner is not None and engine.planner.costs == {}

    def req(strategy, **options):
        return GenerationRequest(prompt="def fibonacci(n):\n", max_new_tokens=8, seed=0,
                                 sampling=SamplingParams(0.0), strategy=strategy, options=options, ignore_eos=True)

    ref = engine.generate_many([req("autoregressive")])[0].token_ids
    assert engine.planner.costs == {}                               # nothing load-aware yet: nothing measured
    out = engine.generate_many([req("speculative", drafter="drafter-large", k=4, plan="load_aware")])[0]
    assert out.token_ids == ref
    assert {"target", "drafter-large", "drafter-small"} <= set(engine.planner.costs)
    assert len(engine.planner.history) > 0 and engine.planner.costs["target"].rows == [1, 2, 4]   # max_batch 4


def test_through_a_draft_side_the_round_trip_is_charged_once_per_step():
    """With a draft side among the handles (the separated topology) a drafter's table is its per-token cost
    through that side and ``costs[DRAFTS]`` the per-call part; the step model charges that part once when
    k > 0 (never at k = 0), instead of a whole call per drafted token.  The measuring requests are released."""
    cfg = load_config("configs/tiny.yaml")
    ensure_built(cfg, progress=False)
    engine = build_engine(cfg)
    side = engine.models[DRAFTS]
    handles = {n: engine.models[n] for n in ("target", "drafter-large", DRAFTS)}
    costs = measure_costs(handles, "target", ["drafter-large"], rows=(1, 2), new_tokens=(1, 3), iters=1)
    assert set(costs) == {"target", "drafter-large", DRAFTS}
    assert costs[DRAFTS].rows == [1, 2] and costs["drafter-large"].tokens == [1]
    assert side.active_requests() == [] and engine.models["drafter-large"].active_requests() == []
    flat = ForwardCost({(1, 1): 0.004, (1, 5): 0.004})
    draft, call = ForwardCost({(1, 1): 0.001}), ForwardCost({(1, 1): 0.002})
    assert step_seconds(0, draft, flat, 1, call_cost=call) == 0.004                    # plain: no call
    assert abs(step_seconds(4, draft, flat, 1, call_cost=call) - (0.002 + 4 * 0.001 + 0.004)) < 1e-12
