"""The load suite on configs/tiny.yaml, in-process only: files written, every request's tokens counted,
requests batched together at c=2, every step in one phase (join, full, drain), and greedy outputs equal to
batch-of-one decoding (lossless)."""
from __future__ import annotations

import argparse
import json

from cluster.bench import SUITES, load
from cluster.config.schema import load_config
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.family import ensure_built
from cluster.local import build_engine

NEW = 8


def test_load_suite_in_process(tmp_path):
    assert SUITES["load"] is load.run
    cfg = load_config("configs/tiny.yaml")
    ensure_built(cfg, progress=False)
    args = argparse.Namespace(prompts="4", max_new_tokens=str(NEW), temperature="0", out=str(tmp_path),
                              concurrency="1,2", runtime="in-process")
    res = load.collect(args, cfg)

    for ext in ("csv", "json", "png"):
        assert (tmp_path / f"bench_load.{ext}").stat().st_size > 0
    rows = json.loads((tmp_path / "bench_load.json").read_text())
    assert rows == res.table
    names = {r["strategy"] for r in rows}
    assert {"autoregressive", "speculative k=4"} <= names
    assert {(r["runtime"], r["concurrency"]) for r in rows} == {("in-process", 1), ("in-process", 2)}
    for r in rows:
        assert r["requests"] == 2 * r["concurrency"]
        assert r["tokens"] == r["requests"] * NEW, r
        assert r["tok_s"] > 0 and r["tpot_p99"] >= r["tpot_p50"] >= 0 and r["ttft_p50"] > 0
    ar2 = next(r for r in rows if r["strategy"] == "autoregressive" and r["concurrency"] == 2)
    assert ar2["mean_batch"] > 1
    for m in res.levels.values():           # every step and token falls in one phase: join, full or drain
        assert sum(v[0] for v in m.phases.values()) == m.steps
        assert sum(v[2] for v in m.phases.values()) == m.tokens
        assert m.phases["join"][0] >= 2     # the first c requests, then their successors
    # autoregressive rows of equal length run in lockstep: both pairs join together and end together, no drain
    assert ar2["drain_share"] == 0 and 0 < ar2["join_share"] < 1 and ar2["full_tok_per_ms"] > 0

    # lossless: every greedy request equals that prompt decoded alone (batch of one, autoregressive)
    engine = build_engine(cfg)
    ref = {}
    for (_, name, c), m in res.levels.items():
        for j, rec in enumerate(m.recs):
            p = j % len(res.prompts)
            if p not in ref:
                ref[p] = engine.generate(GenerationRequest(
                    prompt_ids=list(res.prompts[p]), max_new_tokens=NEW, sampling=SamplingParams(0.0),
                    seed=j, strategy="autoregressive", ignore_eos=True)).token_ids
            assert rec.token_ids == ref[p], (name, c, j)
