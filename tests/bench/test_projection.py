"""The production-70b projection (cluster.bench.projection): the served-step simulation on stated inputs."""
import pytest

from cluster.bench.projection import BATCHES, INPUTS, project


def test_projection_rows_follow_the_inputs():
    rows = {(r["strategy"], r["batch"]): r for r in project()}
    assert {b for _, b in rows} == set(BATCHES)
    assert {r["vs_autoregressive"] for (s, _), r in rows.items() if s == "autoregressive"} == {1.0}
    bare = {r["strategy"]: r for r in project(dict(front_ms=0.0, prompt_tokens=0, critical_tokens=1), batches=(1,))}
    t, d = INPUTS["target_ms"], INPUTS["draft_ms"]
    # one client, no front: a plain step is one target forward; each request's first step also prefills its
    # (empty) prompt, one more forward: 128 steps and one prefill per request
    assert bare["autoregressive"]["step_ms"] == pytest.approx(t * 129 / 128, abs=0.05)
    # synchronous: k drafter forwards + a round trip + a 5-token verification
    assert bare["speculative (sync)"]["step_ms"] == pytest.approx(4 * d + INPUTS["rtt_ms"] + t * INPUTS["verify_factor"],
                                                                  rel=0.03)
    assert bare["speculative (sync)"]["tokens_per_step"] == pytest.approx(3.36, abs=0.3)     # (1 - 0.8^5) / 0.2
    for batch in BATCHES:      # pre-drafting hides the drafts of the steps whose block and bonus guess come true
        pre, sync = rows[("speculative (pre-drafted)", batch)], rows[("speculative (sync)", batch)]
        assert pre["step_ms"] <= sync["step_ms"] + 1e-9
    assert rows[("speculative (pre-drafted)", 1)]["predraft_hits"] > 0.2
    slow = {r["strategy"]: r for r in project(dict(INPUTS, rtt_ms=20.0), batches=(1,))}
    assert slow["speculative (sync)"]["vs_autoregressive"] < rows[("speculative (sync)", 1)]["vs_autoregressive"]
