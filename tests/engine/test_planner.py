"""The load-aware planner: the cost model's draft-length choice, the forward-cost table, the planner's
grouping and estimates on stand-in sequences, and lossless greedy generation on the tiny models."""
from types import SimpleNamespace

import pytest

from cluster.config.schema import load_config
from cluster.core.draft.programs import DRAFTS
from cluster.core.forward_cost import ForwardCost, plan_draft_length
from cluster.core.sampling import SamplingParams
from cluster.core.stats import RequestStats
from cluster.engine.planner import Planner
from cluster.engine.request import GenerationRequest
from cluster.family import ensure_built
from cluster.local import build_engine

FLAT = ForwardCost({(1, 1): 0.010, (1, 9): 0.010, (32, 1): 0.010, (32, 9): 0.010})
# cheap in tokens at one row, steep at 32 rows (the batching notes' shape, exaggerated)
STEEP = ForwardCost({(1, 1): 1.0, (1, 9): 1.2, (32, 1): 2.0, (32, 9): 8.0})
DRAFT = ForwardCost({(1, 1): 0.1, (32, 1): 0.2})


# -- ForwardCost ------------------------------------------------------------------------------------
def test_forward_cost_interpolates_and_extrapolates():
    c = ForwardCost({(1, 1): 1.0, (1, 5): 2.0, (4, 1): 2.0, (4, 5): 6.0})
    assert c(1, 1) == 1.0 and c(4, 5) == 6.0                       # grid points
    assert c(1, 3) == pytest.approx(1.5)                           # along tokens
    assert c(4, 3) == pytest.approx(4.0)
    assert c(2, 1) == pytest.approx(1.0 + 1.0 / 3)                 # along rows
    assert c(2, 3) == pytest.approx(1.5 + 2.5 / 3)                 # bilinear
    assert c(1, 9) == pytest.approx(3.0)                           # beyond: linear extrapolation
    assert c(8, 1) == pytest.approx(2.0 + 4 * 1.0 / 3)
    assert c(8, 9) == pytest.approx(3.0 + 7 / 3 * (10.0 - 3.0))        # both axes beyond the grid
    assert c(-100, 1) == 0.0                                       # never negative
    one = ForwardCost.from_grid({(1, 1): 0.5, (8, 1): 1.2})        # one token measured: flat in tokens
    assert one(8, 1) == one(8, 5) == pytest.approx(1.2)
    assert one(4, 3) == pytest.approx(0.5 + 0.7 * 3 / 7)
    with pytest.raises(ValueError):
        ForwardCost({(1, 1): 1.0, (1, 2): 1.0, (2, 1): 1.0})       # incomplete grid
    mono = ForwardCost({(1, 1): 1.0, (1, 5): 0.9, (4, 1): 0.5, (4, 5): 6.0}).monotone()
    assert mono.table == {(1, 1): 1.0, (1, 5): 1.0, (4, 1): 1.0, (4, 5): 6.0}


# -- plan_draft_length ------------------------------------------------------------------------------
def test_high_alpha_and_flat_target_cost_draft_long():
    assert plan_draft_length([0.95] * 4, None, FLAT, 8, True) == 8
    tiny_draft = ForwardCost({(1, 1): 1e-5, (32, 1): 1e-5})
    assert plan_draft_length([0.95] * 4, tiny_draft, FLAT, 8, False) == 8


def test_alpha_near_zero_does_not_speculate():
    assert plan_draft_length([0.01] * 4, DRAFT, FLAT, 8, False) == 0
    assert plan_draft_length([0.0] * 4, None, FLAT, 8, True) == 0      # free drafts, no gain: ties -> 0
    assert plan_draft_length([], None, FLAT, 8, True) == 0
    assert plan_draft_length([0.9], None, FLAT, 0, True) == 0          # k_max 0


def test_large_batch_with_steep_target_cost_drafts_shorter():
    one, many = plan_draft_length([0.8], DRAFT, STEEP, 8, False), plan_draft_length([0.8] * 32, DRAFT, STEEP, 8, False)
    assert (one, many) == (5, 2)
    # the group is one row but the target forward carries 32: priced at 32 rows
    assert plan_draft_length([0.8], DRAFT, STEEP, 8, False, target_rows=32) == 2
    # the worked example of the docstring
    lin = ForwardCost({(16, 1): 11.0, (16, 2): 12.0})
    steep = ForwardCost({(16, 1): 20.0, (16, 2): 30.0})
    assert plan_draft_length([0.8] * 16, None, lin, 12, True) == 6
    assert plan_draft_length([0.8] * 16, None, steep, 12, True) == 2


def test_deterministic_drafter_ignores_drafter_cost():
    huge = ForwardCost({(1, 1): 100.0, (32, 1): 100.0})
    assert plan_draft_length([0.7] * 4, huge, STEEP, 8, False) == 0
    free = plan_draft_length([0.7] * 4, None, STEEP, 8, True)
    assert free == plan_draft_length([0.7] * 4, huge, STEEP, 8, True) > 0


# -- Planner on stand-in sequences ------------------------------------------------------------------
def _seq(drafter="d", k=8, load_aware=True, accepted=0, drafted=0, steps=0):
    stats = RequestStats(steps=steps, accepted_tokens=accepted, drafted_tokens=drafted)
    return SimpleNamespace(req=SimpleNamespace(strategy=SimpleNamespace(load_aware=load_aware, drafter=drafter, k=k)),
                           ctx=SimpleNamespace(stats=stats, planned_k=None))


def test_planner_groups_by_drafter_caps_k_and_prices_the_whole_batch():
    planner = Planner({"t": STEEP, "d": DRAFT}, "t", prior_alpha=0.8)
    a, b, fixed = _seq(k=8), _seq(k=3), _seq(load_aware=False)
    mag = _seq(drafter="mag", k=6)                                  # no cost table: free drafts
    planner.plan([a, b, fixed, mag])
    assert fixed.ctx.planned_k is None
    assert a.ctx.planned_k == b.ctx.planned_k <= 3                  # one k per drafter, <= min strategy.k
    # before any measurement the choice is the cost model's (the prior), with the planner's margin
    m = planner.margin
    assert a.ctx.planned_k == plan_draft_length([0.8, 0.8], DRAFT, STEEP, 3, False, target_rows=4, margin=m)
    assert mag.ctx.planned_k == plan_draft_length([0.8], None, STEEP, 6, True, target_rows=4, margin=m)
    assert list(planner.history) == [(4, a.ctx.planned_k), (4, mag.ctx.planned_k)]
    assert sum(planner.counts[4].values()) == 2 and planner.last["d"][0] == 4


def test_planner_acceptance_estimate_counts_tried_positions():
    planner = Planner({"t": FLAT}, "t", prior_alpha=0.5, prior_weight=4.0)
    s = _seq(drafter="m")
    planner.plan([s])
    assert planner.alpha("m") == pytest.approx(0.5)
    s.ctx.stats.verification(4, 4)          # 4 accepts
    planner.plan([s])
    s.ctx.stats.verification(4, 1)          # 1 accept, 1 reject (positions 3, 4 never tried)
    planner.plan([s])
    g = (0.5 * 4 + 5) / (4 + 6)
    assert planner.alpha("m") == pytest.approx(g)
    assert planner.last["m"][2] == pytest.approx((g * 4 + 5) / (4 + 6))
    planner.plan([])                        # finished: its counts stay in the drafter's estimate
    assert planner.alpha("m") == pytest.approx(g)
    # a new request starts from the drafter's estimate
    planner.plan([t := _seq(drafter="m")])
    assert planner.last["m"][2] == pytest.approx(g) and t.ctx.planned_k is not None


def test_planner_probes_after_a_run_of_zero_plans():
    """Without observations (no goodput samples) the band keeps its probe interval: every 3rd plan a probe run of
    ``probe_run`` plans, k = 1 then the longest draft (goodput need not be concave in k)."""
    planner = Planner({"t": STEEP, "d": ForwardCost({(1, 1): 50.0, (32, 1): 50.0})}, "t", probe_every=3)
    s = _seq()
    ks = []
    for _ in range(6):
        planner.plan([s])
        ks.append(s.ctx.planned_k)
    assert ks == [0, 0, 1, 1, 1, 8]                     # probe_run = 3


# -- the closed loop on stand-in sequences, synthetic step times ------------------------------------
def _drive(planner, seqs, steps, seconds, accepted=lambda k: k):
    """``steps`` engine steps over ``seqs``: plan, every row commits accepted(k) + 1 tokens (a verification
    of k drafts when k > 0), then observe ``seconds(k, rows)``.  Returns the planned k per step."""
    ks = []
    for _ in range(steps):
        planner.plan(seqs)
        k = seqs[0].ctx.planned_k
        assert all(s.ctx.planned_k == k for s in seqs)
        for s in seqs:
            if k:
                s.ctx.stats.verification(k, accepted(k))
            s.ctx.stats.generated_tokens += accepted(k) + 1
        planner.observe(seconds(k, len(seqs)))
        ks.append(k)
    return ks


def test_closed_loop_leaves_speculation_that_measures_worse():
    """Prior: free drafts and a target flat in tokens -> k = 4.  Measured: each draft token costs 8 ms on a
    10 ms step (4 ms more to speculate at all) and at most one is accepted: k = 0 (100 tok/s) beats k = 1 (91),
    2 (67) and 4 (43)."""
    planner = Planner({"t": FLAT}, "t", probe_every=8)
    seqs = [_seq(drafter="mag", k=4)]
    ks = _drive(planner, seqs, 400, lambda k, b: 0.010 + 0.008 * k + (0.004 if k else 0.0), lambda k: min(k, 1))
    assert ks[0] == 4                                   # the prior speculates
    settled = ks.index(0)
    assert settled <= 3                                 # two samples of k = 4 override the prior
    after = ks[settled:]
    assert sum(k > 0 for k in after) <= len(after) / planner.probe_every    # probes: a bounded fraction
    assert sum(k > 0 for k in ks[-200:]) <= 2 * planner.probe_run   # ... ever rarer (backoff) once they lose
    assert set(after) <= {0, 1, 4}                      # a probe: a neighbour of the best (k = 1) or k_max
    assert planner.report()[("mag", "1")]["best"] == 0


def test_closed_loop_finds_speculation_the_prior_rejects():
    """Prior: a drafter forward costs 5x the target's -> k = 0.  Measured: drafts are nearly free and all
    accepted, so each step of k drafts commits k + 1 tokens in 10 ms + 1 ms * k: the planner climbs to k = 4."""
    drafter = ForwardCost({(1, 1): 0.05, (32, 1): 0.05})
    planner = Planner({"t": FLAT, "d": drafter}, "t", probe_every=8)
    seqs = [_seq(drafter="d", k=4)]
    ks = _drive(planner, seqs, 120, lambda k, b: 0.010 + 0.001 * k)
    assert ks[0] == 0                                   # the prior says plain decoding
    first = next(i for i, k in enumerate(ks) if k > 0)
    assert first < planner.probe_every                  # the first probe (k = 1); a second soon after ...
    assert all(k > 0 for k in ks[first + 3:first + 8])  # ... wins: the planner speculates and climbs
    assert sum(k == 4 for k in ks[-40:]) >= 40 - 2 * planner.probe_run   # settled at k_max (the rest: probes)


def test_closed_loop_bands_learn_independently():
    """Same drafter, same prior (k = 4 everywhere).  One row: drafts cost little -> k = 4.  32 rows (compute
    bound): a step of k drafts costs 20 ms * (1 + 1.5 k) -> plain decoding.  Each band keeps what it learned."""
    planner = Planner({"t": FLAT}, "t", probe_every=8)
    seconds = lambda k, b: 0.010 + 0.001 * k if b == 1 else 0.020 * (1 + 1.5 * k)   # noqa: E731
    one = _drive(planner, [_seq(drafter="mag", k=4)], 60, seconds)
    many = _drive(planner, [_seq(drafter="mag", k=4) for _ in range(32)], 60, seconds)
    assert sum(k == 4 for k in one[-30:]) >= 30 - 2 * planner.probe_run
    assert sum(k == 0 for k in many[-30:]) >= 30 - 2 * planner.probe_run
    again = _drive(planner, [_seq(drafter="mag", k=4)], 10, seconds)     # batch 1 again: still k = 4
    assert again[:3] == [4, 4, 4]
    report = planner.report()
    assert report[("mag", "1")]["best"] == 4 and report[("mag", "32+")]["best"] == 0
    # deterministic: the same observations give the same plans
    twin = Planner({"t": FLAT}, "t", probe_every=8)
    assert _drive(twin, [_seq(drafter="mag", k=4)], 60, seconds) == one


def test_probes_in_a_band_of_near_ties_back_off():
    """k = 1 (the longest draft allowed) measures 4 % above plain decoding, inside the 10 % margin: the band
    stays plain, and a probe of k = 1 that wins by less than the margin counts as lost, so probes back off
    instead of recurring every few plans (each paid a catch-up)."""
    seconds = lambda k, b: 0.010 if k == 0 else 0.01923                     # noqa: E731
    planner = Planner({"t": FLAT}, "t", probe_every=8)
    ks = _drive(planner, [_seq(drafter="mag", k=1)], 400, seconds)
    assert sum(k > 0 for k in ks[-200:]) <= 2 * planner.probe_run
    assert planner.report()[("mag", "1")]["best"] == 0


def _accept_all(planner, seq, steps, seconds, each=None):
    """``steps`` plans of one row whose every draft is accepted; a step takes ``seconds(k, previous k)``;
    ``each()`` after every step.  Returns the planned ks."""
    ks, prev = [], 0
    for _ in range(steps):
        planner.plan([seq])
        k = seq.ctx.planned_k
        if k:
            seq.ctx.stats.verification(k, k)
        seq.ctx.stats.generated_tokens += k + 1
        planner.observe(seconds(k, prev))
        ks.append(k)
        prev = k
        if each is not None:
            each()
    return ks


def _switching(planner, steps, steady, switch):
    """One row, every draft accepted; a step costs steady(k), plus ``switch`` seconds where k changed (the
    drafter's catch-up).  -> (planned ks, wall seconds of the steps that ran k > 0 or switched back, wall seconds
    of all steps)."""
    explored, total = [0.0], [0.0]

    def seconds(k, prev):
        t = steady(k) + (switch if k != prev else 0.0)
        explored[0] += t if (k or k != prev) else 0.0
        total[0] += t
        return t

    return _accept_all(planner, _seq(drafter="d", k=1), steps, seconds), explored[0], total[0]


def test_a_plain_band_spends_at_most_its_probe_budget_on_probes():
    """k = 1 ties plain decoding in steady state (2 tokens in 19.5 ms against 1 in 10 ms: inside the margin),
    but entering it costs a 200 ms catch-up, which no time sample shows.  Once the band decodes plainly its
    probes take at most ``probe_budget`` (10 %) of its wall time (one run and its
    switch back may exceed it before the next is barred); with no budget the backed-off probes take a third."""
    drafter = ForwardCost({(1, 1): 0.05, (32, 1): 0.05})                  # the prior says k = 0
    steady = lambda k: 0.010 if k == 0 else 0.0195                        # noqa: E731
    planner = Planner({"t": FLAT, "d": drafter}, "t", probe_every=8, probe_budget=0.1)
    ks, explored, total = _switching(planner, 600, steady, 0.2)
    run = 0.2 + 3 * 0.0195 + 0.010                                        # one probe run and the switch back
    assert ks[0] == 0 and explored <= planner.probe_budget * total + run
    unbudgeted = Planner({"t": FLAT, "d": drafter}, "t", probe_every=8, probe_budget=float("inf"))
    ks, explored, total = _switching(unbudgeted, 600, steady, 0.2)
    assert explored > 0.3 * total


def test_a_plain_band_whose_probes_keep_losing_explores_ever_less(monkeypatch):
    """The same tie as above over 6,000 steps: each lost probe doubles the band's interval and halves its share of
    the budget, so exploring falls to 2.3 % of its time; with the whole budget for good it stayed at 9 %."""
    def explored_share():
        planner = Planner({"t": FLAT, "d": ForwardCost({(1, 1): 0.05, (32, 1): 0.05})}, "t", probe_every=8,
                          probe_budget=0.1)
        _, explored, total = _switching(planner, 6000, lambda k: 0.0195 if k else 0.010, 0.2)
        return explored / total

    assert explored_share() < 0.03
    whole = lambda band, budget, every: band.probe_seconds <= budget * band.seconds  # noqa: E731
    monkeypatch.setattr("cluster.engine.planner.affordable", whole)
    assert explored_share() > 0.08


def test_a_new_band_starts_from_the_nearest_measured_band():
    """Compute bound at every batch (a step of k drafts costs 20 ms * (1 + 1.5 k)): the cost model (free Max-Gram
    drafts, a flat target) says k = 4, and 8 rows learn that plain decoding wins.  16 rows, a band never seen,
    then decode plainly from their first plan: the neighbour's measured arms stand in for the prior.  A band
    with a single sample of an arm lends nothing (one step can be a prefill's or a catch-up's)."""
    seconds = lambda k, b: 0.020 * (1 + 1.5 * k)                           # noqa: E731
    rows = lambda n: [_seq(drafter="mag", k=4) for _ in range(n)]         # noqa: E731
    planner = Planner({"t": FLAT}, "t", probe_every=8)
    assert _drive(planner, rows(8), 40, seconds)[0] == 4                  # the prior, before any measurement
    assert planner.report()[("mag", "8-15")]["best"] == 0
    assert _drive(planner, rows(16), 3, seconds) == [0, 0, 0]
    assert _drive(Planner({"t": FLAT}, "t", probe_every=8), rows(16), 1, seconds) == [4]    # no neighbour
    once = Planner({"t": FLAT}, "t", probe_every=8)
    _drive(once, rows(8), 1, seconds)                                     # one sample of k = 4 at 8 rows
    assert _drive(once, rows(16), 1, seconds) == [4]


def test_rows_whose_budget_cuts_the_draft_are_not_samples_of_the_planned_k():
    """A request's last steps draft fewer than the planned k (the strategy caps k by its budget): they commit
    one or two tokens, fast.  Counted as samples of k = 4 they would read as a cheap k that commits little;
    they are left out, and a step where every row is capped gives no sample."""
    planner = Planner({"t": FLAT}, "t", probe_every=0)
    full, ending = _seq(drafter="mag", k=4), _seq(drafter="mag", k=4)
    full.ctx.budget, ending.ctx.budget = 40, 2            # ending may draft at most 1 token this step
    planner.plan([full, ending])
    assert full.ctx.planned_k == ending.ctx.planned_k == 4
    full.ctx.stats.generated_tokens += 5                  # k = 4 in full, all accepted
    ending.ctx.stats.generated_tokens += 1                # capped: one token
    planner.observe(0.010)
    full.ctx.budget = 3                                   # now both are capped (2 and 1 drafts at most)
    planner.plan([full, ending])
    arm = planner.report()[("mag", "2-3")]["arms"][4]
    assert arm[:2] == (1, 5.0)                            # one sample: 5 tokens per row (the full row only)
    assert full.ctx.planned_k == 4
    full.ctx.stats.generated_tokens += 3
    ending.ctx.stats.generated_tokens += 1
    planner.observe(0.002)
    planner.plan([full, ending])                          # every row was capped: no sample
    assert planner.report()[("mag", "2-3")]["arms"][4][0] == 1


def test_a_switch_of_k_costs_no_time_sample():
    """The served case that kept a band at k = 0: the step where k changes pays the drafter's catch-up and has
    no pre-drafted block (here +40 ms), so a one-step probe of k = 4 read 54 ms for 5 tokens (93 tok/s, below
    k = 0's 100).  Runs of k cost 10 + k ms per step in steady state; their switch steps give no time sample,
    so the planner climbs to k = 4 (357 tok/s)."""
    drafter = ForwardCost({(1, 1): 0.05, (32, 1): 0.05})          # the prior says k = 0
    planner = Planner({"t": FLAT, "d": drafter}, "t", probe_every=8)
    ks = _accept_all(planner, _seq(drafter="d", k=4), 160, lambda k, prev: 0.010 + 0.001 * k + 0.040 * (k != prev))
    assert ks[0] == 0
    assert sum(k == 4 for k in ks[-40:]) >= 40 - 2 * planner.probe_run
    modelled = 0.010 + 4 * 0.05                                    # FLAT target + 4 drafter forwards
    assert planner.report()[("d", "1")]["arms"][4][2] == pytest.approx(0.014 / modelled)   # steady steps only


def test_a_drafter_prefill_is_spread_over_the_requests_tokens():
    """A planned request's drafters are prefilled inside its first drafting step (cluster/engine/prefill.py).
    That 90 ms is a cost of drafting at all (plain decoding never pays it), paid once per request: every drafting
    step carries its share by the tokens it commits (5 of the request's 60 here: 7.5 ms), not the step that paid
    it alone (one sample 10x the others; a probe on fresh requests paid a whole prefill in three steps) nor none
    (as if drafting cost nothing beyond its forwards, which at high batch hid a prefill on nearly every step)."""
    planner = Planner({"t": FLAT}, "t", probe_every=0)
    seq = _seq(drafter="mag", k=4)
    seq.req.max_new_tokens = 60
    planner.plan([seq])
    planner.prefilled([seq], 0.090)
    seq.ctx.stats.generated_tokens += 5
    planner.observe(0.100)
    for _ in range(11):
        planner.plan([seq])
        seq.ctx.stats.generated_tokens += 5
        planner.observe(0.010)
    planner.plan([seq])
    samples, tokens, ratio = planner.report()[("mag", "1")]["arms"][4]
    assert samples == 12 and ratio == pytest.approx((0.010 + 0.090 / 12) / 0.010)
    plain = Planner({"t": FLAT}, "t", probe_every=0)           # plain decoding: no prefill share
    other = _seq(drafter="mag", k=0)
    plain.plan([other])
    other.ctx.stats.generated_tokens += 1
    plain.observe(0.010)
    plain.plan([other])
    assert plain.report()[("mag", "1")]["arms"][0][2] == pytest.approx(1.0)


def test_hopeless_probes_are_skipped_once_a_draft_length_is_measured():
    """32 rows, compute bound: each draft token adds 6 plain step-lengths.  The prior's first step (k = 2) and
    one probe run of k = 1 measure that (one sample alone can be a cold start, so a single one skips nothing);
    every probe after them (the longest draft, k = 1 again) is estimated from those measured time ratios below
    ``probe_floor`` of plain decoding, so none runs: a run of k = 8 here would cost 147 plain steps.  Without
    the floor the same plans run k = 8 and k = 1 again and again."""
    seconds = lambda k, b: 2.0 * (1 + 6 * k)                            # noqa: E731
    planner = Planner({"t": STEEP, "d": DRAFT}, "t", probe_every=4)
    ks = _drive(planner, [_seq(drafter="d", k=8) for _ in range(32)], 200, seconds)
    assert ks[0] > 0 and ks.count(8) == 0 and ks[1:].count(1) <= planner.probe_run    # one run of k = 1, then none
    unfloored = Planner({"t": STEEP, "d": DRAFT}, "t", probe_every=4, probe_floor=0.0, probe_budget=1.0)
    ks = _drive(unfloored, [_seq(drafter="d", k=8) for _ in range(32)], 200, seconds)
    assert ks.count(8) >= planner.probe_run and ks.count(1) >= planner.probe_run


def test_an_arms_tokens_come_from_the_acceptance_model_not_its_last_samples():
    """Max-Gram's acceptance comes in stretches: an arm's last samples (probe runs of correlated steps) can be
    a stretch of misses, 1 token per step at k = 4, where the acceptance model at the pooled alpha expects 2.6.
    The estimate uses the model: 2.6 tokens in 10 ms."""
    from collections import deque

    from cluster.engine.arms import Band, Pending, estimate
    band = Band(tokens={4: deque([1.0] * 12)}, times={4: deque([1.0] * 12)})
    p = Pending(("d", 0), 4, 4, [1.0, 1.5, 1.9, 2.3, 2.6], [0.01] * 5, [(None, 0)])
    assert estimate(band, p, 4, prior_samples=2) == pytest.approx(2.6 / 0.01)


def test_near_tied_draft_lengths_do_not_flip_the_best():
    """One row, free drafts (Max-Gram), every draft accepted: k = 3 and k = 4 commit 4 and 5 tokens in steps
    whose times alternate by +-6 % around 4 and 5 time units (goodput within noise of each other).  The band's
    best k > 0 changes only when another beats it by half the margin, so it settles (1 change in 400 plans);
    without that lead the swings of the noise flipped it (6 changes), each restarting the probe interval."""
    noise = iter([1.06, 0.94] * 1000)
    seconds = lambda k, b: 0.001 * (k + 1 if k else 2) * next(noise)               # noqa: E731

    def run(margin):
        planner = Planner({"t": FLAT}, "t", probe_every=8, margin=margin)
        bests = []
        _accept_all(planner, _seq(drafter="mag", k=4), 400, lambda k, prev: seconds(k, 1),
                    each=lambda: bests.append(planner.report()[("mag", "1")]["best"]))
        return sum(a != b for a, b in zip(bests, bests[1:])), planner.report()[("mag", "1")]["probes"]

    flips, probes = run(0.10)
    assert flips <= 2 and probes <= 20
    assert run(0.0)[0] > flips                           # no margin, no hysteresis: the best follows the noise


def test_the_acceptance_model_is_scaled_by_what_the_drafter_commits():
    """The model counts a draft of k tokens; a CS Drafting cascade planned at k = 1 drafts a block: 3.75 tokens
    beyond the target's own per step against the model's 0.81.  The drafter's scale is measured / modelled over
    its drafting steps, shrunk toward 1 by ``SCALE_PRIOR`` pseudo-tokens; with no steps it is 1."""
    from cluster.engine.acceptance import SCALE_PRIOR, Acceptance
    acc = Acceptance()
    assert acc.scale("cascade") == 1.0
    for _ in range(10):
        acc.drafted("cascade", 3.75, 0.81)
    assert acc.scale("cascade") == pytest.approx((37.5 + SCALE_PRIOR) / (8.1 + SCALE_PRIOR))
    for _ in range(300):                                # a window of the last 256 steps
        acc.drafted("cascade", 0.81, 0.81)
    assert acc.scale("cascade") == pytest.approx(1.0)


def test_the_planners_scale_compares_with_the_unscaled_model():
    """A drafter planned at k = 1 that commits 5 tokens a step (a cascade's block): the model at alpha -> 1 says 1
    drafted token, 4 are measured, so the scale tends to 4.  Compared with the already scaled expectation, it
    would chase its own square root (~2) and undercount the drafter for good."""
    planner = Planner({"t": FLAT}, "t", probe_every=0)
    _drive(planner, [_seq(drafter="c", k=1)], 60, lambda k, b: 0.010, accepted=lambda k: 4 if k else 0)
    assert planner.acceptance.scale("c") == pytest.approx(4.0, rel=0.08)


def test_an_unmeasured_draft_length_borrows_plain_decodings_excess_seconds():
    """Measured in-process at 32 rows (every step forced to one k), the real step exceeded the modelled one by
    about the same seconds at every k (4.9-6.8 ms) while real / modelled fell from 1.41 to 1.12: the engine's
    per-row work adds to a step.  A band that has measured only plain decoding (12 ms modelled, 17 ms real)
    prices an unmeasured k = 1 (24 ms modelled) at 24 + 5 ms, not at the cost model's 24 ms."""
    from collections import deque

    from cluster.engine.arms import Band, Pending, estimate
    band = Band(tokens={0: deque([1.0] * 3)}, times={0: deque([17.0 / 12.0] * 3)})
    p = Pending(("d", 5), 0, 0, [1.0, 1.81], [0.012, 0.024], [(None, 0)] * 32)
    assert estimate(band, p, 0, prior_samples=2) == pytest.approx(32 * 1.0 / 0.017)
    assert estimate(band, p, 1, prior_samples=2) == pytest.approx(32 * 1.81 / 0.029)      # not 32 * 1.81 / 0.024
    band.times[1] = deque([1.25] * 3)                      # once k = 1 is measured, its own ratio decides
    assert estimate(band, p, 1, prior_samples=2) == pytest.approx(32 * 1.81 / 0.030)


def test_planner_measures_on_first_use_and_retries_a_failed_measurement():
    calls = []

    def measure():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("drafter down")
        return {"t": FLAT}

    planner = Planner(None, "t", measure=measure, retry_every=2)
    planner.plan([_seq(load_aware=False)])
    assert calls == [] and planner.costs == {}          # nothing load-aware: nothing measured
    s = _seq(drafter="mag", k=4)
    planner.plan([s])
    assert calls == [1] and s.ctx.planned_k == 0        # failed: plain decoding, not fixed k
    planner.plan([s])
    assert calls == [1]                                 # retried only after retry_every plans
    planner.plan([s])
    assert len(calls) == 2 and "t" in planner.costs and s.ctx.planned_k == 4
    with pytest.raises(ValueError):
        Planner(None, "t")


# -- end to end: lossless on the tiny models --------------------------------------------------------
PROMPTS = ["def fibonacci(n):\n", "import os\nclass ", "x = [i * i for i in", "for line in open("]


@pytest.fixture(scope="module")
def planned_engine():
    cfg = load_config("configs/tiny.yaml")
    cfg.engine.options["plan"] = "load_aware"           # the default asks for it: build_engine measures
    ensure_built(cfg, progress=False)
    engine = build_engine(cfg, planner=None)
    assert engine.planner is not None and {"target", "drafter-large", "drafter-small"} <= set(engine.planner.costs)
    return engine


def _req(prompt, strategy, **options):
    return GenerationRequest(prompt=prompt, max_new_tokens=24, seed=0, sampling=SamplingParams(0.0),
                             strategy=strategy, options=options, ignore_eos=True)


def test_load_aware_greedy_equals_autoregressive(planned_engine):
    engine = planned_engine
    ref = [r.token_ids for r in engine.generate_many([_req(p, "autoregressive") for p in PROMPTS])]
    assert all(len(r) == 24 for r in ref)
    before = len(engine.planner.history)
    # batch 1
    one = engine.generate_many([_req(PROMPTS[0], "speculative", drafter="drafter-large", k=5, plan="load_aware")])
    assert one[0].token_ids == ref[0]
    assert len(engine.planner.history) > before and all(b == 1 for b, _ in list(engine.planner.history)[before:])
    # batch 4: two drafter groups and a fixed-k request sharing the target forward
    reqs = [_req(PROMPTS[0], "speculative", drafter="drafter-large", k=5, plan="load_aware"),
            _req(PROMPTS[1], "speculative", drafter="drafter-small", k=3, plan="load_aware"),
            _req(PROMPTS[2], "speculative", drafter="drafter-large", k=2, plan="load_aware"),
            _req(PROMPTS[3], "speculative", drafter="drafter-large", k=4, plan="fixed")]
    out = engine.generate_many(reqs)
    assert [r.token_ids for r in out] == ref
    assert 4 in engine.planner.counts
    assert all(k <= 5 for _, k in engine.planner.history)


def test_cascade_load_aware_steps_plainly_or_runs_the_whole_cascade(planned_engine):
    """cs_drafting with plan=load_aware: the planner's arms are 0 (a plain decoding step: nothing drafted) and 1
    (the whole cascade); either way every greedy output equals autoregressive's, batched."""
    engine, measured = planned_engine, planned_engine.planner
    ref = [r.token_ids for r in engine.generate_many([_req(p, "autoregressive") for p in PROMPTS[:3]])]
    out = {}
    huge_call = ForwardCost({(1, 1): 100.0, (32, 1): 100.0})      # a draft-side call no step can repay
    for name, costs in (("plain", {"target": FLAT, DRAFTS: huge_call}), ("cascade", {"target": FLAT})):
        engine.planner = Planner(costs, "target", probe_every=0)
        try:
            out[name] = engine.generate_many([_req(p, "cs_drafting", plan="load_aware") for p in PROMPTS[:3]])
            out[name + "_k"] = [k for _, k in engine.planner.history]
        finally:
            engine.planner = measured
    assert [r.token_ids for r in out["plain"]] == ref and [r.token_ids for r in out["cascade"]] == ref
    assert set(out["plain_k"]) == {0} and all(r.stats.drafted_tokens == 0 for r in out["plain"])
    # free drafts and a flat target: the prior starts with the cascade (later plans follow measurement)
    assert out["cascade_k"][0] == 1 and set(out["cascade_k"]) <= {0, 1}
    assert all(r.stats.drafted_tokens > 0 for r in out["cascade"])


def test_load_aware_greedy_lossless_when_the_plan_speculates(planned_engine):
    """The measured costs of the tiny models may well plan k = 0 (their drafters cost half the target);
    with a flat target and free drafts the plan is k = min(strategy.k) of each group, so this drafts."""
    engine, measured = planned_engine, planned_engine.planner
    ref = [r.token_ids for r in engine.generate_many([_req(p, "autoregressive") for p in PROMPTS[:3]])]
    engine.planner = Planner({"target": FLAT}, "target")
    try:
        reqs = [_req(PROMPTS[0], "speculative", drafter="drafter-large", k=5, plan="load_aware"),
                _req(PROMPTS[1], "speculative", drafter="drafter-small", k=3, plan="load_aware"),
                _req(PROMPTS[2], "speculative", drafter="drafter-large", k=2, plan="load_aware")]
        out = engine.generate_many(reqs)
        history = list(engine.planner.history)
    finally:
        engine.planner = measured
    assert [r.token_ids for r in out] == ref
    # first plans: k = each group's cap; later ones follow the measured acceptance (near 0 for these random
    # models) and the observed step times, but never exceed a group's cap while all three run (batch 3: caps
    # 2 and 3; once the k = 2 request ends first, which depends on timing, drafter-large's cap is 5)
    assert history[:2] == [(3, 2), (3, 3)] and max(k for b, k in history if b == 3) <= 3
    assert all(r.stats.drafted_tokens > 0 for r in out)


def test_a_request_whose_first_drafts_miss_keeps_drafting():
    """A request's own acceptance is shrunk toward the drafter's: three first steps that reject every draft (the
    first tokens after a prompt are the hardest to draft) must not take it to plain decoding, where it drafts
    no more and its estimate can never recover (with a prior weight of 4 trials it did: requests of the
    embedded family at one row then decoded 34-60 steps plainly until the band's next probe; here it decoded
    plainly for all 30 steps)."""
    target = ForwardCost({(1, 1): 0.010, (1, 9): 0.013, (32, 1): 0.010, (32, 9): 0.013})
    drafter = ForwardCost({(1, 1): 0.004, (32, 1): 0.004})           # the family's shape: a draft ~0.3 steps
    planner = Planner({"t": target, "d": drafter}, "t", prior_alpha=0.8)
    seconds = lambda k, prev: 0.010 + 0.0046 * k                     # noqa: E731 - as modelled
    _accept_all(planner, _seq(k=4), 40, seconds)                      # the drafter: every draft accepted
    planner.plan([])                                                  # that request ends
    s = _seq(k=4)
    for _ in range(3):                                                # a new one: its first drafts all miss
        planner.plan([s])
        if k := s.ctx.planned_k:
            s.ctx.stats.verification(k, 0)
        s.ctx.stats.generated_tokens += 1
        planner.observe(seconds(k, k))
    ks = _accept_all(planner, s, 30, seconds)                         # then it drafts as well as the others
    assert sum(k > 0 for k in ks) >= 27, ks


def test_one_cold_first_step_does_not_take_the_scale_to_plain_decoding():
    """A drafter's first drafting step in a process commits least (the first tokens after a prompt) and runs
    cold.  Its scale was shrunk toward 1 by one pseudo-token: one step that drafted nothing of a modelled 2.36
    read 0.30, the model's tokens at k = 4 fell from 3.36 to 1.54, and the fresh band decoded plainly for 55
    plans before a probe found k = 4 again.  With ``SCALE_PRIOR`` = 4 that step reads 0.63."""
    from cluster.engine.acceptance import Acceptance
    acc = Acceptance()
    acc.drafted("d", 0.0, 2.36)
    assert acc.scale("d") == pytest.approx(4 / 6.36)
    assert 1.0 + 2.36 * acc.scale("d") > 2.4      # k = 4 still expects more than 2.4 tokens a step
