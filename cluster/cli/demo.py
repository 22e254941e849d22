"""``specserve demo``: the first half of ``make serve``. Build the family if needed, complete held-out prompts with
plain autoregressive decoding and the configured speculative strategy, greedily and at the demo's sampling
settings, and print speed, acceptance and how many completions fell into a loop."""
from __future__ import annotations

import argparse

from cluster.bench.measure import has_loop
from cluster.cli.common import load_built_config
from cluster.core.sampling import SamplingParams
from cluster.core.stats import RequestStats
from cluster.engine.request import GenerationRequest
from cluster.errors import check_float, check_int
from cluster.family.corpus import heldout_prompts
from cluster.local import build_engine

#: the demo's sampling settings: chosen so that no completion of the demo's held-out prompts loops on the
#: embedded family; speculative sampling is exact at any temperature / top-p
DEMO_TEMPERATURE = 0.8
DEMO_TOP_P = 0.9


def add_demo_command(sub, add_config) -> None:
    d = sub.add_parser("demo", help="build the family if needed, complete held-out prompts, print stats")
    add_config(d)
    d.add_argument("--prompts", default="4")
    d.add_argument("--max-new-tokens", dest="max_new_tokens", default="48")
    d.add_argument("--temperature", default=str(DEMO_TEMPERATURE), help=f"(default {DEMO_TEMPERATURE})")
    d.add_argument("--top-p", dest="top_p", default=str(DEMO_TOP_P), help=f"(default {DEMO_TOP_P})")


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = load_built_config(args.config)
    n = check_int("prompts", args.prompts, 1, 64)
    max_new = check_int("max_new_tokens", args.max_new_tokens, 1, cfg.engine.max_new_tokens_limit)
    demo = SamplingParams(check_float("temperature", args.temperature, 0.0, 100.0),
                          check_float("top_p", args.top_p, 0.0, 1.0, low_open=True))
    engine = build_engine(cfg)
    prompts = heldout_prompts(engine.tokenizer, n)
    strategies = ("autoregressive", cfg.engine.strategy)
    sampled = f"T={demo.temperature:g} top_p={demo.top_p:g}"
    outputs: dict[tuple[str, str], list] = {}
    for label, sampling in (("greedy", SamplingParams(0.0)), (sampled, demo)):
        for strategy in strategies:
            agg = RequestStats(strategy=strategy)
            outputs[label, strategy] = []
            for i, pr in enumerate(prompts):
                res = engine.generate(GenerationRequest(prompt_ids=pr["prompt_ids"], max_new_tokens=max_new,
                                                        sampling=sampling, seed=i, strategy=strategy))
                agg.merge(res.stats)
                outputs[label, strategy].append(res)
            loops = sum(has_loop(r.token_ids) for r in outputs[label, strategy])
            print(f"[{label}] {strategy}: {agg.tokens_per_s:.1f} tok/s, "
                  f"target calls/token {agg.target_calls_per_token:.3f}, accepted/step {agg.mean_accepted:.2f}, "
                  f"completions with a loop (a 4-gram 3+ times): {loops}/{len(prompts)}")
    same = sum(a.token_ids == b.token_ids for a, b in zip(*(outputs["greedy", s] for s in strategies)))
    print(f"greedy {cfg.engine.strategy} == greedy autoregressive on {same}/{len(prompts)} prompts")
    for i, (pr, res) in enumerate(zip(prompts[:2], outputs[sampled, cfg.engine.strategy])):
        print(f"--- held-out prompt {i} ({sampled}, {cfg.engine.strategy}) ---\n{pr['prompt'][-200:]}"
              f"\033[1m{res.text}\033[0m\n")
    return 0
