"""``specserve loadtest``: stages of load against a running cluster, the per-stage table and the files
(see docs/operator-guide.md, "Load tests")."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from cluster.cli.common import require_extra
from cluster.config.schema import load_config
from cluster.errors import ConfigError, ParamError, check_float, check_int
from cluster.loadtest import (
    LoadSpec,
    LoadTestError,
    Target,
    connect_ray,
    load_spec,
    run_loadtest,
    serve_replicas,
)
from cluster.loadtest.prompts import from_file, heldout
from cluster.loadtest.report import format_markdown
from cluster.loadtest.spec import parse_stages, request_spec, stages_from_levels
from cluster.serving.ops.ray_node import use_token


def add_loadtest_command(sub) -> None:
    p = sub.add_parser("loadtest", help="load a running cluster in stages (Poisson rate or concurrency) over "
                                        "gRPC/HTTP; per-stage TTFT/TPOT/ITL/E2E percentiles, CSV/JSON/PNG")
    p.add_argument("--config", default="configs/local.yaml",
                   help="the served config: default ports and app name, tokenizer of the held-out prompts")
    p.add_argument("--grpc", help="gRPC host:port (default 127.0.0.1:<cluster.grpc_port>)")
    p.add_argument("--http", help="HTTP base URL (default http://127.0.0.1:<cluster.http_port>)")
    p.add_argument("--app", help="Serve application, sent as gRPC metadata (default: cluster.app_name)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--spec", help="YAML file of stages and request defaults (docs/operator-guide.md)")
    how.add_argument("--stages", help='e.g. "rate=2:30s,rate=8:30s,c=16:20s:max=200:protocol=http"')
    how.add_argument("--concurrency", help="closed-loop stages, e.g. 1,4,16 (each --duration long)")
    how.add_argument("--rate", help="open-loop Poisson stages in requests/s, e.g. 1,2,4 (each --duration long)")
    p.add_argument("--duration", default="30s", help="per stage with --concurrency / --rate (default 30s)")
    p.add_argument("--max-requests", dest="max_requests", help="per stage with --concurrency / --rate")
    p.add_argument("--protocol", help="grpc (default) or http")
    p.add_argument("--endpoint", help="completions (default) or chat: each prompt as one user message "
                                      "(/v1/chat/completions, gRPC messages)")
    p.add_argument("--model", help="HTTP: the OpenAI model field (another server's model name)")
    p.add_argument("--openai", action="store_true", default=None,
                   help="HTTP, plain OpenAI fields only (no strategy / options; token counts from usage): drive any "
                        "OpenAI-compatible server at --http BASE_URL --model NAME, to compare it with specserve")
    p.add_argument("--no-stream", dest="stream", action="store_false", default=None,
                   help="unary Generate / non-streaming HTTP (no TTFT, TPOT or ITL)")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", help="tokens per request (default 32)")
    p.add_argument("--temperature", help="0 = greedy (default: the server's)")
    p.add_argument("--top-p", dest="top_p")
    p.add_argument("--strategy", help="decoding strategy (default: the server's)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="strategy option, e.g. --option k=4 (repeatable)")
    p.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", default=None,
                   help="generate exactly --max-new-tokens per request")
    p.add_argument("--request-seed", dest="seed", help="seed of request i = this + i (default: random)")
    p.add_argument("--timeout", dest="timeout_s", help="client deadline per request in seconds (default 120)")
    p.add_argument("--prompts", default="16", help="held-out prompts to cycle through (default 16)")
    p.add_argument("--prompts-file", dest="prompts_file", help="prompts from a file (.json, .jsonl or lines)")
    p.add_argument("--seed", dest="run_seed", help="seed of arrivals and prompt choice (default 0)")
    p.add_argument("--max-in-flight", dest="max_in_flight", help="open loop: outstanding requests cap (512)")
    p.add_argument("--no-retry-after", action="store_true",
                   help="closed loop: retry a refused (429 / RESOURCE_EXHAUSTED) client at once, not after Retry-After")
    p.add_argument("--greedy-check", action="store_true",
                   help="check every greedy request's tokens against an autoregressive reference")
    p.add_argument("--reference-strategy", default="autoregressive", help="strategy of the greedy references")
    p.add_argument("--ray-address", dest="ray_address",
                   help="sample Serve's running replicas from this Ray cluster (e.g. auto) for the timeline")
    p.add_argument("--sample-interval", default="1", help="seconds between replica samples (default 1)")
    p.add_argument("--out", default="loadtest_out", help="directory for CSV/JSON/PNG (default loadtest_out)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG timeline")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    p.add_argument("--fail-on-error", action="store_true", help="exit 1 if any request failed")


REQUEST_FLAGS = ("protocol", "stream", "max_new_tokens", "temperature", "top_p", "strategy", "ignore_eos", "seed",
                 "timeout_s", "endpoint", "model", "openai")


def build_spec(args) -> LoadSpec:
    """The stages and request defaults from the flags (``--spec`` file, or a stage list)."""
    overrides = {k: getattr(args, k) for k in REQUEST_FLAGS if getattr(args, k) is not None}
    if args.option:
        for kv in args.option:
            if "=" not in kv:
                raise ParamError("option", "NAME=VALUE", kv)
        overrides["options"] = dict(kv.split("=", 1) for kv in args.option)
    extra = {}
    if args.run_seed is not None:
        extra["seed"] = check_int("seed", args.run_seed, 0, 2**31 - 1)
    if args.max_in_flight is not None:
        extra["max_in_flight"] = check_int("max_in_flight", args.max_in_flight, 1, 100_000)
    if args.no_retry_after:
        extra["retry_after"] = False
    if args.spec:
        return dataclasses.replace(load_spec(args.spec, overrides=overrides), **extra)
    base = request_spec(overrides, "request")
    if args.concurrency or args.rate:
        mode = "concurrency" if args.concurrency else "rate"
        stages = stages_from_levels(mode, args.concurrency or args.rate, args.duration, args.max_requests, base)
    else:
        stages = parse_stages(args.stages or "c=1:30s,c=4:30s", base)
    return LoadSpec(stages, **extra)


def cmd_loadtest(args) -> int:
    require_extra("loadtest", "locust", "matplotlib")
    spec = build_spec(args)
    cfg = load_config(args.config)
    cl = cfg.cluster
    target = Target(grpc=args.grpc or f"127.0.0.1:{cl.grpc_port}", http=args.http or f"http://127.0.0.1:{cl.http_port}",
                    app=args.app or cl.app_name)
    if args.prompts_file:
        prompts = from_file(args.prompts_file)
    else:
        try:
            prompts = heldout(cfg, check_int("prompts", args.prompts, 1, 1024))
        except ConfigError as e:
            raise ConfigError(f"{e}; the held-out prompts need {args.config}'s tokenizer (`specserve zoo build`), "
                              "or pass --prompts-file") from None
    if args.greedy_check and not any(s.request.greedy for s in spec.stages):
        raise ParamError("greedy_check", "a greedy stage (--temperature 0)", "no stage with temperature 0")
    if args.greedy_check and any(s.request.openai for s in spec.stages):
        raise ParamError("greedy_check", "stages without openai (plain OpenAI answers carry no token ids)", "openai")
    replicas = None
    if args.ray_address:
        try:
            use_token(args.ray_address)        # the cluster's Ray token (docs/operator-guide.md, "Secure")
            connect_ray(args.ray_address)
        except ConnectionError as e:
            print(f"specserve: loadtest: cannot join the Ray cluster at {args.ray_address} to count replicas: "
                  f"{str(e).splitlines()[0]}", file=sys.stderr)
            return 1
        replicas = serve_replicas(target.app)
    print(f"specserve loadtest: {len(spec.stages)} stage(s) against gRPC {target.grpc} / HTTP {target.http} "
          f"(app {target.app!r}), {len(prompts)} prompts", file=sys.stderr)
    try:
        res = run_loadtest(spec, prompts, target, out_dir=Path(args.out), replicas=replicas,
                           sample_s=check_float("sample_interval", args.sample_interval, 0.05, 60.0),
                           greedy_check=args.greedy_check, reference_strategy=args.reference_strategy,
                           progress=not args.no_progress, plot=not args.no_plot)
    except LoadTestError as e:
        print(f"specserve: loadtest: {e}", file=sys.stderr)
        return 1
    print(res.table)
    if args.markdown:
        print("\n" + format_markdown(res.stages))
    if res.greedy:
        print(f"greedy check: {res.greedy['checked']} requests checked, {res.greedy['mismatched']} mismatched")
    for w in res.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in res.files.values()), file=sys.stderr)
    if res.greedy.get("mismatched") or (args.fail_on_error and res.failed):
        return 1
    return 0
