"""The ``cascades`` benchmark suite: spec_cascade rules, lossy, token and oracle cascades swept over alpha,
quality (chrF) against cost (walltime, parameter-count cost model, target calls), with tables and plots.

The published variants beside ours (Narasimhan et al., *Faster Cascades via Speculative Decoding*), point by
point over alpha: lossy speculative sampling with beta = 1 (the paper's heuristic and main lossy baseline,
section 2) vs beta solved per position (ours, Tran-Thien's procedure), and GenSpecSample's bonus token from pi
(the later version's Algorithm 4) vs from p (the first version's; our default), on the OPT cascade."""
from __future__ import annotations

import time
from pathlib import Path

from cluster.bench.report import Row, print_table, write_results
from cluster.bench.verify import T1, _prompts, _run, _threads
from cluster.errors import check_int
from cluster.local import build_engine

ALPHAS = {
    "chow": (0.0, 0.2, 0.4, 0.6, 0.8),
    "diff": (-0.1, 0.0, 0.1, 0.2, 0.4),
    "opt": (-0.5, 0.0, 0.3, 0.6, 0.9),
    "token_v1": (0.0, 0.1, 0.2, 0.35, 0.5),
    "token_v2": (0.0, 0.1, 0.2, 0.35, 0.5),
    "token_v3": (0.0, 0.3, 0.6, 0.8, 0.95),
}


LOSSY_ALPHAS = (0.0, 0.3, 0.6, 0.8, 0.95)


CHOW_SEQ_ALPHAS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


ORACLE_ALPHAS = (0.0, 0.2, 0.4)          # oracle Diff cascade: a quality reference (a target call per token)


BONUS_RULE = "opt"                       # the rule whose sweep is repeated with the bonus token from pi

# (variant, the paper's method and setting, ours): compared point by point over alpha
VARIANTS = (("lossy beta", "lossy[beta=1]", "beta=1", "lossy", "beta=solve"),
            ("bonus token", f"spec_cascade[{BONUS_RULE},bonus=pi]", "pi (later version)", f"spec_cascade[{BONUS_RULE}]",
             "p (first version)"))


def compare_variants(points: list[dict]) -> list[dict]:
    """Paper vs ours at every alpha both were run at: chrF, walltime and cost model per token."""
    at = {(p["method"], p["alpha"]): p for p in points}
    out = []
    for variant, paper_m, paper_set, ours_m, ours_set in VARIANTS:
        for (m, alpha), p in at.items():
            o = at.get((ours_m, alpha))
            if m != paper_m or o is None:
                continue
            out.append(dict(variant=variant, alpha=alpha, paper=paper_set, ours=ours_set,
                            paper_chrF=p["chrF"], ours_chrF=o["chrF"],
                            paper_rel_walltime=p["rel_walltime"], ours_rel_walltime=o["rel_walltime"],
                            paper_rel_cost=p["rel_cost_model"], ours_rel_cost=o["rel_cost_model"],
                            paper_drafter_calls_tok=p["drafter_calls_per_token"],
                            ours_drafter_calls_tok=o["drafter_calls_per_token"]))
    return out


def cascade_configs(drafter: str, k: int, rules=None) -> list[tuple[str, str, dict]]:
    """(method, strategy, options) for every point of the sweep, target alone first."""
    out = [("target", "autoregressive", {})]
    for rule in rules or ALPHAS:
        out += [(f"spec_cascade[{rule}]", "spec_cascade", {"drafter": drafter, "k": k, "rule": rule, "alpha": a})
                for a in ALPHAS[rule]]
    out += [(f"spec_cascade[{BONUS_RULE},bonus=pi]", "spec_cascade",
             {"drafter": drafter, "k": k, "rule": BONUS_RULE, "alpha": a, "bonus": "pi"}) for a in ALPHAS[BONUS_RULE]]
    out += [("lossy", "lossy", {"drafter": drafter, "k": k, "alpha": a}) for a in LOSSY_ALPHAS]
    out += [("lossy[beta=1]", "lossy", {"drafter": drafter, "k": k, "alpha": a, "beta": 1.0}) for a in LOSSY_ALPHAS]
    out += [("token_cascade[chow]", "token_cascade", {"drafter": drafter, "alpha": a}) for a in CHOW_SEQ_ALPHAS]
    out += [("oracle[diff]", "oracle_cascade", {"drafter": drafter, "rule": "diff", "alpha": a}) for a in ORACLE_ALPHAS]
    return out


def chrf(hyps: list[str], refs: list[str]) -> float:
    import sacrebleu
    return float(sacrebleu.corpus_chrf(hyps, [refs]).score)


def cheapest_at(points: list[dict], levels: dict[str, float], cost: str) -> list[dict]:
    """For each method and quality level: the cheapest point whose chrF reaches the level."""
    out = []
    for label, level in levels.items():
        row = {"quality": f"{label} (chrF >= {level:.2f})", "cost": cost}
        for m in sorted({p["method"] for p in points if p["method"] != "target"}):
            ok = [p[cost] for p in points if p["method"] == m and p["chrF"] >= level]
            row[m] = round(min(ok), 3) if ok else None
        out.append(row)
    return out


def plot_curves(points: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5), sharey=True)
    methods = [m for m in dict.fromkeys(p["method"] for p in points) if m != "target"]
    target = next(p for p in points if p["method"] == "target")
    for ax, x, label in ((axes[0], "rel_walltime", "walltime per token relative to target alone"),
                         (axes[1], "rel_cost_model", "cost model per token (target = 1, drafter = n_d/n_t)"),
                         (axes[2], "target_calls_per_token", "target calls per generated token")):
        for m in methods:
            pts = sorted((p for p in points if p["method"] == m), key=lambda p: p[x])
            style = "--" if m.startswith("token_cascade") else ":" if m.startswith("lossy") else \
                "-." if m.startswith("oracle") else "-"
            ax.plot([p[x] for p in pts], [p["chrF"] for p in pts], style, marker="o", ms=3, label=m)
        ax.scatter([target[x]], [target["chrF"]], marker="*", s=150, c="k", zorder=5, label="target alone")
        ax.axhline(target["chrF"], color="k", lw=0.5, ls=":")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("chrF vs true continuation")
    axes[2].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def run_cascades(args, cfg) -> int:
    threads = _threads()
    engine = build_engine(cfg)
    n = check_int("prompts", args.prompts, 1, 256)
    max_new = check_int("max_new_tokens", args.max_new_tokens, 1, cfg.engine.max_new_tokens_limit)
    items = _prompts(engine, n)
    drafter = cfg.engine.options.get("drafter") or cfg.drafters[0]
    k = int(cfg.engine.options.get("k", 4))
    configs = cascade_configs(drafter, k)
    rows = [Row(f"{m} {o.get('alpha', '')}") for m, _, o in configs]
    hyps: list[list[str]] = [[] for _ in configs]
    for m, s, o in configs:                                                   # warm-up (not timed)
        _run(engine, s, o, T1, 8, items[0]["prompt_ids"][:16], 0, Row("w"))
    t_start = time.perf_counter()
    for i, it in enumerate(items):
        order = list(range(len(configs)))
        if i % 2:
            order.reverse()
        for j in order:
            m, s, o = configs[j]
            res = _run(engine, s, o, T1, max_new, it["prompt_ids"], 2000 + i, rows[j])
            hyps[j].append(engine.tokenizer.decode(res.token_ids))
        print(f"  prompt {i + 1}/{len(items)} done ({time.perf_counter() - t_start:.0f}s)", flush=True)
    refs = [it["reference"] for it in items]
    base = rows[0]
    base_s_per_tok = base.seconds / base.tokens
    # parameter-count cost model (noise-free on a shared machine): a drafter pass costs n_d / n_t target passes
    ratio = engine.models[drafter].num_params / max(1, engine.models[cfg.target].num_params)
    points = []
    for (m, s, o), row, hy in zip(configs, rows, hyps):
        points.append(dict(method=m, alpha=o.get("alpha"), chrF=round(chrf(hy, refs), 3),
                           rel_walltime=round((row.seconds / row.tokens) / base_s_per_tok, 4),
                           rel_cost_model=round((row.target_calls + ratio * row.draft_calls) / row.tokens, 4),
                           target_calls_per_token=round(row.calls_per_token, 4),
                           drafter_calls_per_token=round(row.draft_calls / row.tokens, 4),
                           accepted_per_call=round(row.accepted_per_call, 3), tokens_per_s=round(row.tokens_per_s, 2)))
    title = (f"cascades: {drafter} -> {cfg.target}, k={k}, temperature 1, {len(items)} held-out prompts x {max_new} "
             f"tokens, config {cfg.source}, {threads} thread(s)")
    print_table(points, title)
    target_q = points[0]["chrF"]
    floor = max((p["chrF"] for p in points if p["method"] == "token_cascade[chow]" and p["alpha"] == 1.0),
                default=min(p["chrF"] for p in points))
    levels = {"target": target_q}
    if floor < target_q:       # the drafter alone is worse: also report points part-way up the gap
        levels.update({f"{f:.0%} of gap": floor + f * (target_q - floor) for f in (0.9, 0.75, 0.5)})
    summary = (cheapest_at(points, levels, "rel_walltime") + cheapest_at(points, levels, "rel_cost_model")
               + cheapest_at(points, levels, "target_calls_per_token"))
    print_table(summary, "cheapest point per method reaching each quality level (gap = drafter-only .. target chrF)")
    versus = compare_variants(points)
    print_table(versus, "cascades: the paper's variants beside ours, same prompts and seeds")
    out = Path(args.out)
    write_results(versus, out, "bench_cascades_variants")
    write_results(points, out, "bench_cascades")
    write_results(summary, out, "bench_cascades_summary")
    plot_curves(points, out / "bench_cascades.png", title)
    print(f"results written to {out / 'bench_cascades'}.{{csv,json,png}}")
    return 0
