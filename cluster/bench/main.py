"""Main benchmark suite: our engine vs the Hugging Face ``generate`` peers on the same models.

Rows: autoregressive; speculative for every drafter and k in ``--ks``; HF ``generate`` (plain),
``generate(assistant_model=drafter)`` with ``num_assistant_tokens=k`` (constant schedule) and
``generate(prompt_lookup_num_tokens=k)``.  All rows run on the same weights and held-out prompts,
interleaved prompt by prompt in one process, after one warm-up run each.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from cluster.bench.report import Row, parse_ints, print_table, write_results
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import check_int
from cluster.family.corpus import heldout_prompts
from cluster.local import build_engine


def parse_ks(text: str) -> list[int]:
    return parse_ints("ks", text, 1, 16)


def bench_prompts(engine, n: int) -> list[list[int]]:
    return [p["prompt_ids"] for p in heldout_prompts(engine.tokenizer, n)]


class _CallCounter:
    """Counts forward calls of an HF module (for the peers' target/drafter call columns)."""

    def __init__(self, module):
        self.calls = 0
        self._h = module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1

    def close(self):
        self._h.remove()


def engine_runner(engine, strategy: str, options: dict, sampling: SamplingParams, max_new: int):
    def run(ids: list[int], seed: int, row: Row) -> None:
        t0 = time.perf_counter()
        res = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=max_new, sampling=sampling,
                                                seed=seed, strategy=strategy, options=options,
                                                ignore_eos=True))
        row.record(res.stats, time.perf_counter() - t0)
    return run


def hf_runner(engine, sampling: SamplingParams, max_new: int, *, assistant: str | None = None,
              k: int | None = None, lookup: int | None = None):
    target = engine.models[engine.target].model
    draft = engine.models[assistant].model if assistant else None
    kwargs = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=not sampling.greedy,
                  pad_token_id=engine.tokenizer.eos_token_id)
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
    if draft is not None:
        kwargs["assistant_model"] = draft
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup

    def run(ids: list[int], seed: int, row: Row) -> None:
        if draft is not None:
            draft.generation_config.num_assistant_tokens = k
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            draft.generation_config.assistant_confidence_threshold = 0.0
        torch.manual_seed(seed)
        counters = [_CallCounter(target)] + ([_CallCounter(draft)] if draft is not None else [])
        x = torch.tensor([ids])
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(x, attention_mask=torch.ones_like(x), **kwargs)
            row.seconds += time.perf_counter() - t0
        finally:
            for c in counters:
                c.close()
        new = out.shape[1] - x.shape[1]
        calls = counters[0].calls - 1                     # the first call is the prompt's prefill
        row.tokens += new
        row.target_calls += calls
        if draft is not None:
            row.draft_calls += counters[1].calls
        if draft is not None or lookup:
            row.steps += calls
            row.accepted += new - calls
    return run


def run(args, cfg) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()          # generate()'s deprecation chatter would bury the table
    engine = build_engine(cfg)
    n = check_int("prompts", args.prompts, 1, 256)
    max_new = check_int("max_new_tokens", args.max_new_tokens, 1, cfg.engine.max_new_tokens_limit)
    temperature = float(args.temperature)
    sampling = SamplingParams(temperature)
    ks = parse_ks(args.ks)
    prompts = bench_prompts(engine, n)
    drafters = [d for d in cfg.drafters if d in engine.models]

    runners: dict[str, object] = {"autoregressive": engine_runner(engine, "autoregressive", {}, sampling, max_new)}
    for d in drafters:
        for k in ks:
            runners[f"speculative {d} k={k}"] = engine_runner(engine, "speculative", {"drafter": d, "k": k},
                                                              sampling, max_new)
    if not args.no_peers:
        runners["hf generate"] = hf_runner(engine, sampling, max_new)
        for d in drafters:
            for k in ks:
                runners[f"hf assisted {d} k={k}"] = hf_runner(engine, sampling, max_new, assistant=d, k=k)
        for k in ks:
            runners[f"hf prompt-lookup k={k}"] = hf_runner(engine, sampling, max_new, lookup=k)

    for name, fn in runners.items():                       # warm-up (not timed)
        fn(prompts[0][:16], 0, Row(name))
    rows = {name: Row(name) for name in runners}
    for i, ids in enumerate(tqdm(prompts, desc="bench main", unit="prompt")):
        for name, fn in runners.items():
            fn(ids, i, rows[name])

    base = rows["autoregressive"]
    table = [rows[name].as_dict(base) for name in runners]
    title = (f"main: {len(prompts)} held-out prompts x {max_new} new tokens, temperature {temperature}, "
             f"config {cfg.source}")
    print_table(table, title)
    write_results(table, Path(args.out), f"bench_main_t{temperature:g}")
    print(f"results written to {Path(args.out) / f'bench_main_t{temperature:g}'}.{{csv,json}}")
    return 0
