"""CLI commands for the CS Drafting / SpecDec++ / Max-Gram tooling: ``specserve tune`` (predicted-best k and
K-matrices measured beside the prediction), ``specserve train-head`` (a SpecDec++ acceptance head for a
drafter) and ``specserve mag build-bigram`` (the Max-Gram bigram table)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from cluster.bench.cs import Runner, run_rows, with_mag
from cluster.bench.main import bench_prompts
from cluster.bench.report import print_table
from cluster.bench.tune import tune_choices
from cluster.cli.common import load_built_config
from cluster.config.paths import default_bigram_path, zoo_dir
from cluster.core.cost_model import (
    format_kmatrix,
    swi,
)
from cluster.core.sampling import SamplingParams
from cluster.errors import ParamError, check_float, check_int
from cluster.family.bigram import build_bigram, corpus_texts
from cluster.family.heads import train_head
from cluster.local import build_engine
from cluster.models.build import build_handles, load_tokenizer
from cluster.models.head import HEAD_DIR, save_head
from cluster.models.maxgram import save_bigram


def cmd_tune(args) -> int:
    """``specserve tune``: predicted-best k and K-matrices, then measured beside the prediction; with
    ``--grid N`` also the N best-predicted K-matrices per cascade are measured (grid search check).  The
    prediction charges every forward by its measured cost at the tokens it feeds; the pick of the paper's
    per-call model (one unit per model run) is measured beside it.  K-matrices are in review steps
    (``kmatrix_unit=reviews``, the cost model's unit)."""
    cfg = with_mag(load_built_config(args.config))
    engine = build_engine(cfg)
    n = check_int("prompts", args.prompts, 1, 64)
    max_new = check_int("max_new_tokens", args.max_new_tokens, 1, cfg.engine.max_new_tokens_limit)
    grid = check_int("grid", args.grid, 0, 50)
    sampling = SamplingParams(check_float("temperature", args.temperature, 0.0, 100.0))
    prompts = bench_prompts(engine, n)
    choice = tune_choices(engine, cfg, sampling, prompts[:min(4, n)], n_tokens=min(48, max_new))
    costs = choice["costs"]
    runners = {"autoregressive": (Runner(engine, "autoregressive", "autoregressive", {}, sampling, max_new), 1.0)}
    for d, (k, pred) in choice["speculative"].items():
        k_call = choice["speculative_per_call"][d][0]
        for kk, tag in ((k, "(tuned)"),) + (((k_call, "(per-call pick)"),) if k_call != k else ()):
            strat, opts = ("mag", {"k": kk}) if d == cfg.mag.name else ("speculative", {"drafter": d, "k": kk})
            runners[f"{strat} {d} k={kk} {tag}"] = (Runner(engine, "", strat, opts, sampling, max_new),
                                                    pred if kk == k else None)
    picks = {}
    for lst, ranked in choice["cascade"].items():
        per_call = choice["cascade_per_call"][lst][0][0]
        cands = [(K, pred, "(tuned)" if i == 0 else f"(grid #{i + 1})") for i, (K, pred) in enumerate(ranked[:max(1, grid)])]
        if per_call not in [K for K, _, _ in cands]:
            cands.append((per_call, dict(ranked)[per_call], "(per-call pick)"))
        picks[lst] = format_kmatrix(per_call)
        for K, pred, tag in cands:
            runners[f"cs_drafting [{lst}] K={format_kmatrix(K)} {tag}"] = (
                Runner(engine, "", "cs_drafting", {"drafters": lst, "kmatrix": format_kmatrix(K),
                                                    "kmatrix_unit": "reviews"}, sampling, max_new), pred)
    run_rows({k: v[0] for k, v in runners.items()}, prompts, "tune: measuring")
    base = runners["autoregressive"][0].row
    table = []
    for name, (fn, pred) in runners.items():
        table.append(dict(name=name, predicted_ewif=None if pred is None else round(pred, 3),
                          measured_swi=round(swi(fn.stats, costs, engine.target), 3),
                          measured_speedup=round(fn.row.tokens_per_s / base.tokens_per_s, 3) if base.tokens_per_s else None,
                          tokens_per_s=round(fn.row.tokens_per_s, 1), cpu_tokens_per_s=round(fn.cpu_tokens_per_s, 1),
                          accepted_per_call=round(fn.row.accepted_per_call, 3)))
    print_table(table, f"tune: prediction (EWIF, forwards charged by length) beside measurement, temperature "
                       f"{sampling.temperature:g}, {len(prompts)} prompts x {max_new} tokens")
    if grid > 1:
        for lst in choice["cascade"]:
            mine = [r for r in table if r["name"].startswith(f"cs_drafting [{lst}]")]
            for key, clock in (("tokens_per_s", "wall"), ("cpu_tokens_per_s", "CPU")):
                top = max(mine, key=lambda r: r[key])
                for tag in ("(tuned)", f"K={picks[lst]} "):
                    pick = next(r for r in mine if tag in r["name"])
                    ratio = pick[key] / top[key] if top[key] else 0.0
                    who = "tuned K (by length)" if tag == "(tuned)" else "per-call pick"
                    print(f"[{lst}] {clock} {who} {pick[key]:.1f} tok/s vs best measured in grid {top[key]:.1f} "
                          f"({top['name']}): {ratio:.3f} -> {'within 5%' if ratio >= 0.95 else 'NOT within 5%'}")
    return 0


# -- command line: `specserve train-head`, `specserve tune`, `specserve mag build-bigram` -------------
def add_cs_commands(sub) -> None:
    t = sub.add_parser("train-head", help="train a SpecDec++ acceptance head for a drafter (Huang et al., SpecDec++)")
    t.add_argument("--config", default="configs/local.yaml")
    t.add_argument("--drafter", help="drafter model name (default: the config's first drafter)")
    t.add_argument("--out", help="head directory (default: <zoo cache>/specdec-head/<drafter> for zoo models)")
    t.add_argument("--prompts", default="64", help="training prompts from the training split")
    t.add_argument("--response-tokens", dest="response_tokens", default="48")
    t.add_argument("--depth", default="2", help="residual blocks D")
    t.add_argument("--w-rej", dest="w_rej", default="1.0", help="BCE weight of rejections (w_acc = 1)")
    t.add_argument("--mix", default="0.3", help="token mixing: fraction of target tokens in the drafter input")
    t.add_argument("--epochs", default="6")
    t.add_argument("--seed", default="0")

    u = sub.add_parser("tune", help="measure acceptance and costs, pick k and K-matrices by predicted speed")
    u.add_argument("--config", default="configs/local.yaml")
    u.add_argument("--prompts", default="6")
    u.add_argument("--max-new-tokens", dest="max_new_tokens", default="64")
    u.add_argument("--temperature", default="0")
    u.add_argument("--grid", default="0", help="also measure the N best-predicted K-matrices per cascade")

    m = sub.add_parser("mag", help="the Max-Gram drafter")
    msub = m.add_subparsers(dest="mag_command", required=True)
    b = msub.add_parser("build-bigram", help="build a bigram table (most frequent successor per token)")
    b.add_argument("--config", default="configs/local.yaml", help="its target's tokenizer is used")
    b.add_argument("--corpus", action="append", default=[],
                   help="text file(s) (default: the zoo's training corpus, the Python standard library)")
    b.add_argument("--max-chars", dest="max_chars", default="4000000")
    b.add_argument("--out", help="output .npy (default: where the loader looks for this config)")


def run_cs_command(args) -> int:
    if args.command == "tune":
        return cmd_tune(args)
    if args.command == "train-head":
        return cmd_train_head(args)
    return cmd_build_bigram(args)


def cmd_build_bigram(args) -> int:
    cfg = with_mag(load_built_config(args.config))
    max_chars = check_int("max_chars", args.max_chars, 1, 10**10)
    tok = load_tokenizer(cfg)
    if args.corpus:
        texts = []
        for f in args.corpus:
            p = Path(f)
            if not p.is_file():
                raise ParamError("corpus", "existing text files", f)
            texts.append(p.read_text(errors="replace")[:max_chars])
    else:
        texts = corpus_texts(max_chars)
    out = Path(args.out) if args.out else default_bigram_path(cfg)
    if out is None:
        raise ParamError("out", "an output path (this config's tokenizer has no default location)", None)
    t0 = time.perf_counter()
    table = build_bigram(tok, texts)
    save_bigram(table, out)
    print(f"bigram table for {len(table)} tokens from {sum(map(len, texts))} characters "
          f"in {time.perf_counter() - t0:.1f}s -> {out}")
    return 0


def cmd_train_head(args) -> int:

    cfg = load_built_config(args.config)
    drafter = args.drafter or cfg.drafters[0]
    if drafter not in cfg.drafters:
        raise ParamError("drafter", "one of " + ", ".join(cfg.drafters), drafter)
    kw = dict(prompts=check_int("prompts", args.prompts, 1, 4096),
              response_tokens=check_int("response_tokens", args.response_tokens, 1, 512),
              depth=check_int("depth", args.depth, 0, 8),
              w_rej=check_float("w_rej", args.w_rej, 0.0, 1000.0, low_open=True),
              mix=check_float("mix", args.mix, 0.0, 1.0, high_open=True),
              epochs=check_int("epochs", args.epochs, 1, 1000), seed=check_int("seed", args.seed, 0, 2**31 - 1))
    spec = cfg.models[drafter]
    if args.out:
        out = Path(args.out)
    elif spec.zoo is not None:
        out = zoo_dir(cfg) / HEAD_DIR / spec.zoo
    else:
        raise ParamError("out", "a head directory (the drafter is not from the zoo)", None)
    workers, tok = build_handles(cfg, [cfg.target, drafter]), load_tokenizer(cfg)
    head, info = train_head(workers[cfg.target].model, workers[drafter].model, tok, progress=True, **kw)
    save_head(head, out, {"drafter": drafter, **info})
    print(json.dumps(info, indent=2))
    print(f"head saved to {out}")
    return 0
