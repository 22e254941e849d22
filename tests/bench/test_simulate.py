"""The served-step simulation (cluster.bench.simulate): literal cases whose answers follow from the inputs."""
import pytest

from cluster.bench.simulate import Strategy, Unit, simulate
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


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="clients"):
        simulate(Unit(TARGET), Strategy("x"), 0, 1, 1)
