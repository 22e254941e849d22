"""The grammar suite's table, driven in-process on a tiny config (the full suite: `--suite grammar`)."""
from __future__ import annotations

import dataclasses

from cluster.bench import SUITES, grammar
from cluster.config.schema import MagSpec, load_config
from cluster.family import ensure_built


def test_engine_rows_count_the_grammar_calls_per_token():
    cfg = dataclasses.replace(load_config("configs/tiny.yaml"), mag=MagSpec())
    ensure_built(cfg, progress=False)
    assert SUITES["grammar"] is grammar.run
    rows = {r["strategy"]: r for r in grammar.engine_rows(cfg, 1)}
    assert set(rows) == {"autoregressive", "speculative", "cs_drafting"}
    assert 1.0 <= rows["autoregressive"]["grammar calls/token"] < 1.1     # one target row per token (+ the end)
    assert rows["speculative"]["grammar calls/token"] > 2                 # the drafter's masks and the target's rows
    assert all(0 < r["grammar share"] < 1 for r in rows.values())
