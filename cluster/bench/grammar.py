"""``specserve bench --suite grammar``: the grammar's share of a step in the engine (llguidance,
:mod:`cluster.models.grammar`).

Greedy JSON answers under one schema (an object of a string, an enum, a bounded integer and a list of strings)
with autoregressive, speculative and CS Drafting decoding, in-process on the config's models: wall ms per
emitted token, and the time and calls spent asking the grammar (the target's rows, every drafter's masks,
Max-Gram cuts), i.e. the grammar's share of a step.
"""
from __future__ import annotations

import time
from pathlib import Path

from cluster.bench.report import print_table, write_results
from cluster.core.sampling import SamplingParams
from cluster.errors import check_int
from cluster.engine.request import GenerationRequest
from cluster.local import build_engine
from cluster.models.grammar import json_grammar

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["city", "unit", "days", "tags"], "additionalProperties": False}


class _Timed:
    """A grammar whose requests' states count their calls and the seconds spent in them (in-process only)."""

    def __init__(self, grammar):
        self.grammar, self.field, self.calls, self.seconds = grammar, grammar.field, 0, 0.0

    def start(self, prompt_length: int):
        inner, outer = self.grammar.start(prompt_length), self

        class State:
            def allowed(self, tokens):
                t0 = time.perf_counter()
                try:
                    return inner.allowed(tokens)
                finally:
                    outer.calls += 1
                    outer.seconds += time.perf_counter() - t0
        return State()


def engine_rows(cfg, n: int) -> list[dict]:
    """Per emitted token of greedy JSON answers through the in-process engine: wall ms, and the ms and calls
    spent asking the grammar (target rows, every drafter's masks, Max-Gram cuts)."""
    engine = build_engine(cfg)
    rows = []
    for strategy in ("autoregressive", "speculative", "cs_drafting"):
        timed = _Timed(json_grammar(SCHEMA, engine.tokenizer))
        req = dict(prompt="# user: the weather as JSON\n# assistant:\n", sampling=SamplingParams(0.0), seed=0,
                   strategy=strategy, max_new_tokens=256, grammar=timed)
        engine.generate(GenerationRequest(**req))                      # warm-up (compiles, caches)
        timed.calls, timed.seconds = 0, 0.0
        t0, tokens = time.perf_counter(), 0
        for _ in range(n):
            tokens += len(engine.generate(GenerationRequest(**req)).token_ids)
        wall = time.perf_counter() - t0
        rows.append({"strategy": strategy, "V": engine.vocab_size, "tokens": tokens, "ms/token": wall / tokens * 1e3,
                     "grammar ms/token": timed.seconds / tokens * 1e3, "grammar calls/token": timed.calls / tokens,
                     "us/call": timed.seconds / max(timed.calls, 1) * 1e6, "grammar share": timed.seconds / wall})
    return rows


def run(args, cfg) -> int:
    out = Path(args.out or "bench_out")
    n = check_int("prompts", args.prompts, 1, 256)
    rows = engine_rows(cfg, n)
    print_table(rows, f"per emitted token in the engine, greedy, {n} requests each")
    write_results(rows, out, "bench_grammar_engine")
    return 0
