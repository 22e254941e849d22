"""The production-70b projection (cluster.bench.projection): the cost model's arithmetic on stated inputs."""
import pytest

from cluster.bench.projection import INPUTS, project


def test_projection_rows_follow_the_cost_model():
    rows = {(r["strategy"], r["batch"]): r for r in project()}
    assert {r["vs_autoregressive"] for (s, _), r in rows.items() if s == "autoregressive"} == {1.0}
    one = rows[("speculative (sync)", 1)]
    # k drafter forwards + a round trip + a 5-token verification; (1 - 0.8^5) / 0.2 tokens per step
    assert one["step_ms"] == pytest.approx(4 * 2.0 + 1.0 + 9.0 * 1.05)
    assert one["tokens_per_step"] == pytest.approx(3.36, abs=0.01)
    for batch in (1, 32):      # pre-drafting hides the drafts of the steps whose block and bonus guess come true
        assert rows[("speculative (pre-drafted)", batch)]["step_ms"] < rows[("speculative (sync)", batch)]["step_ms"]
    slow = {r["strategy"]: r for r in project(dict(INPUTS, rtt_ms=20.0)) if r["batch"] == 1}
    assert slow["speculative (sync)"]["vs_autoregressive"] < one["vs_autoregressive"]   # round trips cost
