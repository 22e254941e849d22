"""``specserve`` command line: generate, zoo, bench, results, demo, loadtest.

Bad arguments print one line naming the parameter, its allowed range and the value, and exit 2.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

from cluster.cli.bench import cmd_bench
from cluster.cli.cluster import add_cluster_commands, run_cluster_command
from cluster.cli.common import EXIT_USAGE, configure_threads, load_built_config
from cluster.cli.cs import add_cs_commands, run_cs_command
from cluster.cli.demo import add_demo_command, cmd_demo
from cluster.cli.loadtest import add_loadtest_command, cmd_loadtest
from cluster.cli.results import add_results_command, cmd_results
from cluster.cli.serve_config import add_serve_config_options, cmd_serve_config
from cluster.config.paths import default_cache_dir
from cluster.errors import ConfigError, ParamError, check_int
from cluster.family import build_family
from cluster.family.cache import load_manifest
from cluster.family.evaluate import format_summary
from cluster.local import build_engine
from cluster.serving.fronts.requests import Fields, build_request
from cluster.strategies import REGISTRY, all_options, check_option_name


def _add_config(p: argparse.ArgumentParser, default: str = "configs/local.yaml") -> None:
    p.add_argument("--config", default=default, help=f"YAML config (default: {default})")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", help="0 = greedy (default: the config's)")
    p.add_argument("--top-p", dest="top_p", help="nucleus mass in (0, 1]")
    p.add_argument("--top-k", dest="top_k", help="keep the k most likely tokens (0 = off)")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", help="tokens to generate")
    p.add_argument("--seed", help="random seed (default: random, reported)")


def _add_strategy_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", help="one of: " + ", ".join(sorted(REGISTRY)))
    for opt in all_options().values():
        p.add_argument("--" + opt.name.replace("_", "-"), dest="opt_" + opt.name, help=opt.help)


def version() -> str:
    """The installed distribution's version (pyproject.toml's ``version``), as pip and ``--version`` show it."""
    try:
        return importlib.metadata.version("specserve")
    except importlib.metadata.PackageNotFoundError:      # run from a source tree that was never installed
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="Speculative decoding engine and cluster")
    parser.add_argument("--version", action="version", version=f"specserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion in-process")
    _add_config(g)
    g.add_argument("--prompt", required=True, help="prompt text")
    _add_strategy_options(g)
    _add_sampling(g)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print token ids, text and statistics as JSON")

    z = sub.add_parser("zoo", help="the embedded model family")
    zsub = z.add_subparsers(dest="zoo_command", required=True)
    zb = zsub.add_parser("build", help="train tokenizer, target and drafters (cached)")
    zb.add_argument("--cache-dir", help="default: $SPECSERVE_CACHE or ~/.cache/specserve")
    zb.add_argument("--force", action="store_true", help="rebuild even if cached")
    zb.add_argument("--seed", default="0")
    info = zsub.add_parser("info", help="the cached family's sizes, losses, agreement and costs")
    info.add_argument("--cache-dir")
    info.add_argument("--json", action="store_true", help="print the whole manifest as JSON")

    b = sub.add_parser("bench", help="benchmark strategies and Hugging Face peers side by side")
    _add_config(b)
    b.add_argument("--prompts", default="8", help="held-out prompts (default 8)")
    b.add_argument("--max-new-tokens", dest="max_new_tokens", default="64")
    b.add_argument("--ks", default="2,4,6", help="comma-separated draft lengths for the k sweep")
    b.add_argument("--temperature", default="0")
    b.add_argument("--no-peers", action="store_true", help="skip the Hugging Face generate() peers")
    b.add_argument("--out", default="bench_out", help="directory for the CSV/JSON results")
    b.add_argument("--suite", default="main", help="comma-separated benchmark suites (default: main)")
    b.add_argument("--concurrency",
                   help="load and served suites: comma-separated client counts (default 1,2,4,8,16,32)")
    b.add_argument("--runtime", help="load, gpu, shapes and chat suites: comma-separated of in-process, cluster "
                   "(default both)")
    b.add_argument("--vocabs", help="shapes suite: comma-separated vocabulary sizes (default 4096,32000,128256)")
    b.add_argument("--rows", help="shapes suite: comma-separated batch sizes (default 1,8,32)")
    b.add_argument("--conversations", type=int, help="chat suite: conversations that run together (default 8)")
    b.add_argument("--turns", type=int, help="chat suite: turns per conversation (default 4)")
    b.add_argument("--device", help="gpu suite: cpu, cuda or cuda:N (default: the first CUDA device; none: exit 2)")
    b.add_argument("--strategies", help="served suite: comma-separated of autoregressive, default, speculative, "
                   "mag, cs_drafting (default all the config serves)")
    b.add_argument("--requests-per-cell", dest="requests_per_cell",
                   help="served suite: requests per cell, at least c (instead of --requests-per-client)")
    b.add_argument("--modes", help="served suite: comma-separated of unary, streamed (default both)")
    b.add_argument("--topologies", help="served suite: comma-separated of separated, colocated, speculator (default all)")
    b.add_argument("--channels", help="served suite: the separated unit's draft channels, comma-separated of "
                   "ray, socket (default: the config's)")
    b.add_argument("--requests-per-client", dest="requests_per_client",
                   help="served suite: requests per client per cell (default: max(2c, 8) requests per cell)")
    b.add_argument("--time-limit", dest="time_limit", help="served suite: no new cell after this many seconds "
                   "(default 3600)")

    add_results_command(sub)                     # results: bench output -> docs/results.md
    add_demo_command(sub, _add_config)
    add_cluster_commands(sub)                    # up, down, client
    add_serve_config_options(sub.choices["serve-config"])
    add_cs_commands(sub)                         # train-head, tune, mag build-bigram
    add_loadtest_command(sub)                    # loadtest
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command != "zoo":          # the zoo build picks its training threads itself
            configure_threads()
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "zoo":
            return cmd_zoo(args)
        if args.command == "serve-config":
            return cmd_serve_config(args)
        if args.command in ("up", "down", "client"):
            return run_cluster_command(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "results":
            return cmd_results(args)
        if args.command == "demo":
            return cmd_demo(args)
        if args.command in ("train-head", "tune", "mag"):
            return run_cs_command(args)
        if args.command == "loadtest":
            return cmd_loadtest(args)
    except (ParamError, ConfigError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_USAGE


def request_from_args(args, cfg):
    """A GenerationRequest from CLI flags over the config's defaults (the one request path,
    :mod:`cluster.serving.fronts.requests`); the strategy and its options are range-checked before any model loads."""
    options = {name: getattr(args, "opt_" + name) for name in all_options()
               if getattr(args, "opt_" + name, None) is not None}
    strategy = args.strategy or cfg.engine.strategy
    if strategy not in REGISTRY:
        raise ParamError("strategy", "one of " + ", ".join(sorted(REGISTRY)), strategy)
    for name, value in options.items():       # name and range checked before loading any model
        check_option_name(strategy, name)
        all_options()[name].parse(value)
    return build_request(cfg, Fields(prompt=args.prompt, max_new_tokens=args.max_new_tokens, seed=args.seed,
                                     temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                     stop=tuple(args.stop), strategy=strategy, options=options))


def cmd_generate(args) -> int:
    cfg = load_built_config(args.config)
    if not args.prompt:
        raise ParamError("prompt", "non-empty text", args.prompt)
    req = request_from_args(args, cfg)
    engine = build_engine(cfg)
    result = engine.generate(req)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(args.prompt + result.text)
        print(format_stats(result.stats), file=sys.stderr)
    return 0


def format_stats(s) -> str:
    return (f"[{s.strategy}] {s.generated_tokens} tokens in {s.wall_s:.2f}s ({s.tokens_per_s:.1f} tok/s); "
            f"target calls {s.target_forwards}, drafter calls {sum(s.drafter_forwards.values())}, "
            f"accepted/step {s.mean_accepted:.2f}, acceptance {s.acceptance_rate:.2f}, "
            f"accepted histogram {s.accepted_hist}")


def cmd_zoo(args) -> int:
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
    if args.zoo_command == "build":
        build_family(cache, seed=check_int("seed", args.seed, 0, 2**31 - 1), force=args.force, progress=True)
        return 0
    manifest = load_manifest(cache)
    if manifest is None:
        print(f"specserve: no model family built in {cache}; run `specserve zoo build`", file=sys.stderr)
        return 1
    print(json.dumps(manifest, indent=2) if args.json else format_summary(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
