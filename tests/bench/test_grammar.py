"""The grammar suite's two tables, driven in-process on small inputs (the full suite: `--suite grammar`)."""
from __future__ import annotations

import dataclasses

from cluster.bench import SUITES, grammar
from cluster.config.schema import MagSpec, load_config
from cluster.family import ensure_built


def test_engines_table_walks_a_valid_answer_for_every_installed_engine(tmp_path):
    from transformers import PreTrainedTokenizerFast
    assert SUITES["grammar"] is grammar.run
    hf = grammar._bpe(600, tmp_path, files=40)                 # a small BPE, trained as the suite trains its own
    assert isinstance(hf, PreTrainedTokenizerFast)
    rows = grammar.engines_table({"small": hf})
    assert "llguidance" in {r["engine"] for r in rows}
    for r in rows:                                     # _walk asserts every token of the answer was allowed
        assert r["V"] == len(hf) and r["steps"] == len(hf.encode(grammar.ANSWER))
        assert 0 < r["mask+advance p50 us"] <= r["p90 us"] and r["schema compile ms"] > 0


def test_engine_rows_count_the_grammar_calls_per_token():
    cfg = dataclasses.replace(load_config("configs/tiny.yaml"), mag=MagSpec())
    ensure_built(cfg, progress=False)
    rows = {r["strategy"]: r for r in grammar.engine_rows(cfg, 1)}
    assert set(rows) == {"autoregressive", "speculative", "cs_drafting"}
    assert 1.0 <= rows["autoregressive"]["grammar calls/token"] < 1.1     # one target row per token (+ the end)
    assert rows["speculative"]["grammar calls/token"] > 2                 # the drafter's masks and the target's rows
    assert all(0 < r["grammar share"] < 1 for r in rows.values())
