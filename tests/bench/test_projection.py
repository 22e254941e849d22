"""The production-70b projection (cluster.bench.projection): expected tokens per step over the step's seconds, on
stated inputs, checked against the formula worked by hand."""
import pytest

from cluster.bench.projection import BATCHES, INPUTS, project

# round numbers: a step's seconds and tokens can be worked out on paper
SIMPLE = dict(target_ms=10.0, verify_factor=1.5, batch32_factor=2.0, draft_ms=1.0, draft_batch32_factor=3.0,
              rtt_ms=0.5, alpha_drafter=0.5, alpha_mag=0.0, k=2)


def _rows(inputs, batches):
    return {(r["strategy"], r["batch"]): r for r in project(inputs, batches=batches)}


def test_one_row_step_is_k_drafts_a_call_and_a_verification():
    rows = _rows(SIMPLE, (1,))
    ar, spec, mag = (rows[(s, 1)] for s in ("autoregressive", "speculative", "mag"))
    assert (ar["step_ms"], ar["tokens_per_step"], ar["tok_s_per_stream"], ar["vs_autoregressive"]) == (10.0, 1.0,
                                                                                                     100.0, 1.0)
    # 2 drafts of 1 ms + a 0.5 ms call + a 3-token verification of 15 ms; (1 - 0.5^3) / (1 - 0.5) = 1.75 tokens
    assert spec["step_ms"] == pytest.approx(17.5) and spec["tokens_per_step"] == pytest.approx(1.75)
    assert spec["tok_s_per_stream"] == pytest.approx(1.75 / 0.0175, abs=0.05)
    assert spec["vs_autoregressive"] == pytest.approx(1.0, abs=1e-3)
    # Max-Gram drafts for free; accepting nothing it still pays the call and the longer verification
    assert mag["step_ms"] == pytest.approx(15.5) and mag["tokens_per_step"] == 1.0
    assert mag["vs_autoregressive"] == pytest.approx(10.0 / 15.5, abs=1e-3)


def test_costs_follow_the_batch_linearly_between_1_and_32_rows():
    rows = _rows(SIMPLE, (1, 16, 32))
    assert rows[("autoregressive", 32)]["step_ms"] == pytest.approx(20.0)
    # 2 drafts of 3 ms + 0.5 ms + a verification of 30 ms
    assert rows[("speculative", 32)]["step_ms"] == pytest.approx(36.5)
    at16 = 10.0 * (1 + 15 / 31)                                  # 15/31 of the way from 1 row to 32
    assert rows[("autoregressive", 16)]["step_ms"] == pytest.approx(at16, abs=0.01)
    assert rows[("speculative", 16)]["step_ms"] == pytest.approx(2 * (1 + 2 * 15 / 31) + 0.5 + 1.5 * at16, abs=0.01)


def test_full_acceptance_gives_k_plus_one_tokens_and_a_dearer_call_lowers_the_ratio():
    full = _rows(dict(SIMPLE, alpha_drafter=1.0, alpha_mag=1.0), (1,))
    assert full[("speculative", 1)]["tokens_per_step"] == 3.0 and full[("mag", 1)]["tokens_per_step"] == 3.0
    slow = _rows(dict(SIMPLE, rtt_ms=20.0), (1,))
    assert slow[("speculative", 1)]["vs_autoregressive"] < _rows(SIMPLE, (1,))[("speculative", 1)]["vs_autoregressive"]


def test_the_shipped_inputs_project_every_batch_and_unknown_inputs_are_refused():
    rows = _rows(None, BATCHES)
    assert {b for _, b in rows} == set(BATCHES) and {s for s, _ in rows} == {"autoregressive", "speculative", "mag"}
    t, d, k = INPUTS["target_ms"], INPUTS["draft_ms"], INPUTS["k"]
    one = rows[("speculative", 1)]
    assert one["step_ms"] == pytest.approx(k * d + INPUTS["rtt_ms"] + t * INPUTS["verify_factor"], abs=0.01)
    assert one["tokens_per_step"] == pytest.approx((1 - 0.8 ** 5) / 0.2, abs=1e-3)
    with pytest.raises(ValueError, match="front_ms"):
        project(dict(front_ms=2.0))
