"""``specserve bench --suite grammar``: what constrained decoding costs, per grammar engine and per step.

1. **Grammar engines side by side** (the measurement behind choosing llguidance, :mod:`cluster.models.grammar`):
   for the config's tokenizer and two byte-level BPE tokenizers trained here on the standard library's source
   (targets of 32,000 and 128,000 tokens), one JSON schema (an object of a string, an
   enum, a bounded integer and a list of strings): the tokenizer set-up, the schema's compile time, and per
   step of a valid answer the mask (bitmask + advance) and its unpacking to a bool ``[V]`` mask, median and p90
   over the answer's tokens.  llguidance always; xgrammar and outlines-core where installed (not dependencies:
   ``pip install xgrammar outlines-core`` to compare).
2. **In the engine**: greedy JSON answers under the schema with autoregressive, speculative and CS Drafting
   decoding, in-process on the config's models: wall ms per emitted token, and the time and calls spent asking
   the grammar (the target's rows, every drafter's masks, Max-Gram cuts), i.e. the grammar's share of a step.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import time
from pathlib import Path

import llguidance
import llguidance.hf
import numpy as np
import torch

from cluster.bench.report import print_table, write_results
from cluster.core.sampling import SamplingParams
from cluster.errors import check_int
from cluster.engine.request import GenerationRequest
from cluster.local import build_engine
from cluster.models.build import load_tokenizer
from cluster.models.grammar import JSON_OPTIONS, json_grammar

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["city", "unit", "days", "tags"], "additionalProperties": False}
ANSWER = json.dumps({"city": "San Francisco, California", "unit": "fahrenheit", "days": 7,
                     "tags": ["weather", "forecast", "weekend plans"]})
BPE_SIZES = (32_000, 128_000)


def _bits(packed: bytes, V: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(packed, dtype=np.uint8), bitorder="little")[:V].astype(bool)


def _walk(ids, mask, advance, V) -> dict:
    """Per step: mask (+ advance), and unpacking; asserts every token of the answer is allowed."""
    step, unpack = [], []
    for t in ids:
        a = time.perf_counter()
        packed = mask()
        b = time.perf_counter()
        allowed = _bits(packed, V)
        c = time.perf_counter()
        assert allowed[t], f"token {t} of a valid answer refused"
        advance(t)
        step.append(time.perf_counter() - c + b - a)
        unpack.append(c - b)
    step.sort()
    return {"mask+advance p50 us": statistics.median(step) * 1e6, "p90 us": step[int(0.9 * (len(step) - 1))] * 1e6,
            "unpack p50 us": statistics.median(unpack) * 1e6, "steps": len(ids)}


def _llguidance(hf, V):
    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=V)
    t1 = time.perf_counter()
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=JSON_OPTIONS))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, m.compute_bitmask, m.consume_token


def _xgrammar(hf, V):
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V)
    t1 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    t2 = time.perf_counter()
    m, bm = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, V)

    def mask():
        m.fill_next_token_bitmask(bm, 0)
        return bm[0].numpy().tobytes()
    return t1 - t0, t2 - t1, mask, m.accept_token


def _outlines(hf, V):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    vocab: dict[str, list[int]] = {}
    for token, i in hf.get_vocab().items():
        if i != hf.eos_token_id:
            vocab.setdefault(hf.convert_tokens_to_string([token]), []).append(i)
    voc = Vocabulary(hf.eos_token_id, vocab)
    t1 = time.perf_counter()
    guide = Guide(Index(build_regex_from_schema(json.dumps(SCHEMA), r"( )?"), voc))
    t2 = time.perf_counter()
    bm = torch.zeros((V + 31) // 32, dtype=torch.int32)

    def mask():
        guide.write_mask_into(bm.data_ptr(), bm.numel(), 4)
        return bm.numpy().tobytes()
    return t1 - t0, t2 - t1, mask, guide.advance


ENGINES = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines}


def _bpe(size: int, out: Path, files: int | None = None):
    """A byte-level BPE of ``size`` tokens trained on the standard library's source (its first ``files`` files;
    cached under ``out``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    path = out / f"bpe-{size}"
    if not (path / "tokenizer.json").exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        paths = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "**", "*.py"), recursive=True))[:files]
        tok.train_from_iterator((open(p, encoding="utf-8", errors="ignore").read() for p in paths),
                                trainers.BpeTrainer(vocab_size=size, special_tokens=["<|endoftext|>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


def engines_table(tokenizers: dict) -> list[dict]:
    rows = []
    for label, hf in tokenizers.items():
        V = len(hf)
        ids = hf.encode(ANSWER, add_special_tokens=False)
        for name, setup in ENGINES.items():
            try:
                t_tok, t_compile, mask, advance = setup(hf, V)
            except ImportError:
                continue
            rows.append({"tokenizer": label, "V": V, "engine": name, "tokenizer setup ms": t_tok * 1e3,
                         "schema compile ms": t_compile * 1e3, **_walk(ids, mask, advance, V)})
    return rows


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
    tokenizers = {}
    own = load_tokenizer(cfg)
    if hasattr(own, "tok"):
        tokenizers["config's"] = own.tok
    for size in BPE_SIZES:
        tokenizers[f"BPE {size // 1000}k target"] = _bpe(size, out / "grammar-tokenizers")
    rows = engines_table(tokenizers)
    print_table(rows, "grammar engines: one JSON schema, per step of a valid answer")
    n = check_int("prompts", args.prompts, 1, 256)
    erows = engine_rows(cfg, n)
    print_table(erows, f"per emitted token in the engine, greedy, {n} requests each")
    write_results(rows, out, "bench_grammar_engines")
    write_results(erows, out, "bench_grammar_engine")
    return 0
