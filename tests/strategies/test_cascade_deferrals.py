"""The cascades' deferral statistics (RequestStats.deferrals / deferral_checks, exported as the
specserve_cascade_deferrals counters): exact at the alpha ends, and tied to the target calls of the
sequential token cascade."""
from __future__ import annotations

import pytest

from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest

NEVER, ALWAYS = 1.0, -2.0      # the alpha ends of every cascade rule


def _stats(engine, strategy, **options):
    req = GenerationRequest(prompt="def add(a, b):", max_new_tokens=16, sampling=SamplingParams(1.0), seed=5,
                            strategy=strategy, options=options, ignore_eos=True)
    return engine.generate(req).stats


@pytest.mark.parametrize("rule", ["chow", "diff", "opt", "token_v1", "token_v2", "token_v3"])
def test_spec_cascade_deferrals_at_the_alpha_ends(tiny_engine, rule):
    always = _stats(tiny_engine, "spec_cascade", rule=rule, alpha=ALWAYS, k=3)
    assert always.deferral_checks == always.drafted_tokens > 0
    assert always.deferrals == pytest.approx(always.deferral_checks)
    never = _stats(tiny_engine, "spec_cascade", rule=rule, alpha=NEVER, k=3)
    assert never.deferral_checks == never.drafted_tokens > 0 and never.deferrals == 0


def test_token_cascade_defers_once_per_target_call(tiny_engine):
    for alpha in (NEVER, 0.3, 0.9):
        st = _stats(tiny_engine, "token_cascade", alpha=alpha)
        assert st.deferral_checks == sum(st.drafter_forwards.values()) >= 16
        assert st.deferrals == st.target_forwards                # each deferral is one target pass
    assert _stats(tiny_engine, "token_cascade", alpha=NEVER).deferrals == 0
    assert _stats(tiny_engine, "oracle_cascade", rule="chow", alpha=ALWAYS).deferrals == 16
    assert _stats(tiny_engine, "autoregressive").deferral_checks == 0
