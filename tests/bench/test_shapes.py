"""`bench --suite shapes` on small vocabularies: the before/after table, files and plot it promises, and greedy
outputs of the batched sampler equal the per-row reference's on a real (random-weight) HF model, batched."""
import json
from types import SimpleNamespace

import pytest

from cluster.bench.shapes import run
from cluster.errors import ParamError


def test_shapes_suite_writes_the_before_after_table(tmp_path, capsys):
    args = SimpleNamespace(vocabs="64,256", rows="1,3", out=str(tmp_path), cache_dir=str(tmp_path / "cache"),
                           runtime="in-process")
    assert run(args, None) == 0
    rows = json.loads((tmp_path / "bench_shapes.json").read_text())
    assert len(rows) == 2 * 2 * 2 * 3                     # V x rows x T x strategy
    assert {(r["V"], r["rows"]) for r in rows} == {(64, 1), (64, 3), (256, 1), (256, 3)}
    for r in rows:
        assert r["model_ms"] > 0 and r["step_ms_before"] > 0 and r["step_ms_after"] > 0
        if r["T"] == 0:
            assert r["greedy_equal"] is True, r
        if r["V"] == 256:
            assert "vocab_passes_after" in r and "vocab_passes_before" in r
    assert {r["strategy"] for r in rows} == {"autoregressive", "speculative", "cs_drafting"}
    assert (tmp_path / "bench_shapes.csv").exists() and (tmp_path / "bench_shapes.png").stat().st_size > 0
    assert "own_ms_before" in capsys.readouterr().out


@pytest.mark.slow
def test_shapes_suite_serves_the_largest_rows_and_gets_the_same_tokens(tmp_path):
    """The served column: the cells of the largest row count through Ray Serve (colocated, gRPC on 127.0.0.1)
    under both samplers, every greedy output equal to the in-process one of its sampler."""
    args = SimpleNamespace(vocabs="64", rows="1,3", out=str(tmp_path), cache_dir=str(tmp_path / "cache"))
    assert run(args, None) == 0
    rows = json.loads((tmp_path / "bench_shapes.json").read_text())
    served = [r for r in rows if r["rows"] == 3 and r["strategy"] != "cs_drafting"]     # in-process only
    assert len(served) == 4 and not any("served_tok_s_after" in r for r in rows if r["rows"] == 1)
    for r in served:
        assert r["served_tok_s_before"] > 0 and r["served_tok_s_after"] > 0 and r["served_failed"] == 0
        if r["T"] == 0:                                  # sampled rows may differ by a float rounding
            assert r["served_equal"] == 1.0, r           # of the batch (served_cells' docstring)
        assert 0.0 <= r["served_equal"] <= 1.0


def test_shapes_suite_refuses_bad_sizes(tmp_path):
    with pytest.raises(ParamError, match="vocabs"):
        run(SimpleNamespace(vocabs="8", rows="1", out=str(tmp_path)), None)
    with pytest.raises(ParamError, match="rows"):
        run(SimpleNamespace(vocabs="64", rows="x", out=str(tmp_path)), None)
    with pytest.raises(ParamError, match="runtime"):
        run(SimpleNamespace(vocabs="64", rows="1", out=str(tmp_path), runtime="gpu"), None)
