"""Benchmark suite ``cs`` and ``specserve tune``: MaG, CS Drafting and SpecDec++ against speculative
decoding and the Hugging Face peers (Chen et al., *Cascade Speculative Drafting for Even Faster LLM
Inference*, section 5; Huang et al., *SpecDec++: Boosting Speculative Decoding via Adaptive Candidate
Lengths*, section 5).

Rows (greedy and temperature 1, same held-out prompts, interleaved prompt by prompt): autoregressive;
speculative with each drafter (every k of ``--ks``; the best is marked); ``mag``; CS Drafting with
[mag], [small, mag], [large, mag], [large, small, mag] (K-matrices chosen by :func:`tune_choices`);
SpecDec++ per drafter with a head; HF assisted generation per drafter and prompt lookup per k.
Columns add the SWI (Chen et al. 2024, CS Drafting, section 5.1) with parameter counts (``swi_params``)
and with the measured per-call latencies (``swi_latency``).  A PNG plots the acceptance probability by
draft position (Chen et al. 2024, CS Drafting, figure 2).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from tqdm import tqdm

from cluster.bench.main import bench_prompts, hf_runner, parse_ks
from cluster.bench.measure import proposal_latency
from cluster.bench.report import Row, print_table, write_results
from cluster.bench.tune import neural_drafters, tune_choices
from cluster.config.schema import MagSpec
from cluster.core.cost_model import (
    format_kmatrix,
    model_costs,
    swi,
)
from cluster.core.sampling import SamplingParams
from cluster.core.stats import RequestStats
from cluster.engine.engine import Engine
from cluster.engine.request import GenerationRequest
from cluster.errors import check_int
from cluster.family.bigram import ensure_bigram
from cluster.local import build_engine
from cluster.models.build import build_handle, model_vocab_size
from cluster.models.maxgram import MagHandle

PAPER_MAG = "mag-paper"         # the Max-Gram drafter read the paper's way: first occurrence, no match cap


def with_mag(cfg):
    """``cfg`` with the Max-Gram drafter served (config section ``mag``), added if absent, and its
    bigram table built if missing (callers are entry points)."""
    cfg = cfg if cfg.mag is not None else dataclasses.replace(cfg, mag=MagSpec())
    ensure_bigram(cfg)
    return cfg


def paper_engine(cfg) -> Engine:
    """The in-process engine over ``cfg``'s models plus :data:`PAPER_MAG`, a second Max-Gram drafter over the
    same bigram table that copies after the *first* earlier occurrence of the longest suffix match, of any
    length (Chen et al., CS Drafting, appendix A), beside the config's (most recent, capped at 24)."""
    mag = build_handle(cfg, cfg.mag.name, vocab_size=model_vocab_size(cfg, cfg.target))
    return build_engine(cfg, extra={PAPER_MAG: MagHandle(mag.vocab_size, mag.bigram, name=PAPER_MAG,
                                                          occurrence="first", max_ngram=0)})


class Runner:
    """Runs one strategy configuration on a prompt, accumulating a Row and a merged RequestStats."""

    def __init__(self, engine, name, strategy, options, sampling, max_new):
        self.engine, self.name, self.strategy, self.options = engine, name, strategy, options
        self.sampling, self.max_new = sampling, max_new
        self.row, self.stats = Row(name), RequestStats(strategy=strategy)
        self.cpu_seconds = 0.0         # this process's CPU time: on a shared machine, free of other jobs' load

    def __call__(self, ids, seed, timed=True):
        t0, c0 = time.perf_counter(), time.process_time()
        res = self.engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=self.max_new,
                                                     sampling=self.sampling, seed=seed, strategy=self.strategy,
                                                     options=self.options, ignore_eos=True))
        if not timed:
            return
        self.row.record(res.stats, time.perf_counter() - t0)
        self.cpu_seconds += time.process_time() - c0
        self.stats.merge(res.stats)

    @property
    def cpu_tokens_per_s(self) -> float:
        return self.row.tokens / self.cpu_seconds if self.cpu_seconds else 0.0


def run_rows(runners, prompts, desc):
    for fn in runners.values():
        fn(prompts[0][:16], 0, Row("warmup")) if not isinstance(fn, Runner) else fn(prompts[0][:16], 0, timed=False)
    for i, ids in enumerate(tqdm(prompts, desc=desc, unit="prompt")):
        for fn in runners.values():
            fn(ids, i) if isinstance(fn, Runner) else fn(ids, i, fn.row)


def _hf(engine, sampling, max_new, name, **kw):
    fn = hf_runner(engine, sampling, max_new, **kw)
    fn.row = Row(name)
    return fn


def plot_acceptance(curves: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted)")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args, cfg) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = with_mag(cfg)
    engine = paper_engine(cfg)
    mag = cfg.mag.name
    n = check_int("prompts", args.prompts, 1, 256)
    max_new = check_int("max_new_tokens", args.max_new_tokens, 1, cfg.engine.max_new_tokens_limit)
    ks = parse_ks(args.ks)
    prompts = bench_prompts(engine, n)
    neural = neural_drafters(engine, cfg)
    out_dir = Path(args.out)
    param_costs = model_costs(engine.models)

    lat = proposal_latency(engine.models[mag])
    print_table([{"context_tokens": k, "mag_propose_us": round(v, 1)} for k, v in lat.items()],
                "MaG proposal latency (k=8, incremental index)")
    summary = []
    for temperature in (0.0, 1.0):
        sampling = SamplingParams(temperature)
        choice = tune_choices(engine, cfg, sampling, prompts[:min(4, n)], n_tokens=min(48, max_new))
        latency_costs = choice["costs"]
        runners: dict[str, object] = {"autoregressive": Runner(engine, "autoregressive", "autoregressive", {},
                                                                sampling, max_new)}
        for d in neural:
            for k in ks:
                runners[f"speculative {d} k={k}"] = Runner(engine, f"speculative {d} k={k}", "speculative",
                                                            {"drafter": d, "k": k}, sampling, max_new)
        for k in ks:
            runners[f"mag k={k}"] = Runner(engine, f"mag k={k}", "mag", {"k": k}, sampling, max_new)
        for lst, ranked in choice["cascade"].items():
            K = format_kmatrix(ranked[0][0])
            name = f"cs_drafting [{lst}] K={K}"
            runners[name] = Runner(engine, name, "cs_drafting", {"drafters": lst, "kmatrix": K,
                                                                 "kmatrix_unit": "reviews"}, sampling, max_new)
        for d in neural:
            if getattr(engine.models[d], "specdec_head", None):
                name = f"specdec_pp {d}"
                runners[name] = Runner(engine, name, "specdec_pp", {"drafter": d}, sampling, max_new)
        if not args.no_peers:
            for d in neural:
                for k in ks:
                    runners[f"hf assisted {d} k={k}"] = _hf(engine, sampling, max_new, f"hf assisted {d} k={k}",
                                                            assistant=d, k=k)
            for k in ks:
                runners[f"hf prompt-lookup k={k}"] = _hf(engine, sampling, max_new, f"hf prompt-lookup k={k}",
                                                         lookup=k)
        pairs = paper_pairs(choice, neural, mag)
        for _, _, paper, _, ours in pairs:
            for opts in (paper, ours):
                name = variant_name(opts)
                runners[name] = Runner(engine, name, "cs_drafting", opts, sampling, max_new)
        run_rows(runners, prompts, f"bench cs t={temperature:g}")
        base = runners["autoregressive"].row
        table = []
        for name, fn in runners.items():
            d = fn.row.as_dict(base)
            if isinstance(fn, Runner):
                d["swi_params"] = round(swi(fn.stats, param_costs, engine.target), 3)
                d["swi_latency"] = round(swi(fn.stats, latency_costs, engine.target), 3)
            table.append(d)
        title = (f"cs: {len(prompts)} held-out prompts x {max_new} new tokens, temperature {temperature:g}, "
                 f"config {cfg.source}")
        print_table(table, title)
        write_results(table, out_dir, f"bench_cs_t{temperature:g}")
        curves = {}
        kmax = max(ks)
        for name, fn in runners.items():
            if isinstance(fn, Runner) and name.endswith(f"k={kmax}") and fn.stats.steps:
                curves[name] = [a / fn.stats.steps for a in fn.stats.accepted_per_pos[:kmax]] + \
                    [0.0] * max(0, kmax - len(fn.stats.accepted_per_pos))
        plot_acceptance(curves, out_dir / f"acceptance_by_position_t{temperature:g}.png",
                        f"acceptance by draft position (k={kmax}, T={temperature:g})")
        versus = compare_pairs(pairs, {r["name"]: r for r in table})
        print_table(versus, f"cs: the papers' variants beside ours (cs_drafting), temperature {temperature:g}")
        write_results(versus, out_dir, f"bench_cs_variants_t{temperature:g}")
        summary.append(goals(table))
        for line in summary[-1]:
            print(line)
    print(f"results written to {out_dir}/bench_cs_t{{0,1}}.{{csv,json}} and acceptance_by_position_t*.png")
    return 0


def reviewing_k(K) -> str:
    """``K`` with every review-step entry of 1 raised to 2: where the two readings of an entry differ (an entry
    of 1 is one review step either way)."""
    n = len(K)
    return format_kmatrix([[2 if (j < n - 1 and v == 1) else v for j, v in enumerate(row)] for row in K])


def paper_pairs(choice, neural: list[str], mag: str) -> list[tuple[str, str, dict, str, dict]]:
    """(variant, the paper's setting, its cs_drafting options, ours, its options) for Chen et al., *Cascade
    Speculative Drafting*: MaG occurrence (appendix A), what a K-matrix entry counts (Algorithm
    "CascadeSpeculativeDraftingStep"; on every list's tuned K with review entries >= 2, and on the paper's
    K = [[2,10],[0,10]]) and lenience on MaG drafts (appendix B; at lenience 4: greedy, a lenience <= 2 accepts
    a one-hot MaG token only where it is the reviewer's argmax anyway)."""
    mag_k = str(choice["speculative"][mag][0])
    out = [(f"MaG occurrence [{mag}] K={mag_k}", "first, uncapped", dict(drafters=PAPER_MAG, kmatrix=mag_k),
            "recent, capped at 24", dict(drafters=mag, kmatrix=mag_k))]
    for lst, ranked in choice["cascade"].items():
        if lst != mag:
            K = reviewing_k(ranked[0][0])
            out.append((f"K unit [{lst}] K={K}", "tokens", dict(drafters=lst, kmatrix=K, kmatrix_unit="tokens"),
                        "reviews", dict(drafters=lst, kmatrix=K, kmatrix_unit="reviews")))
    for d in neural:
        lst = f"{d},{mag}"
        out.append((f"K unit [{lst}] K=2,10;0,10", "tokens", dict(drafters=lst, kmatrix="2,10;0,10",
                                                                  kmatrix_unit="tokens"),
                    "reviews", dict(drafters=lst, kmatrix="2,10;0,10", kmatrix_unit="reviews")))
    if neural:
        small = f"{neural[-1]},{mag}"
        K = format_kmatrix(choice["cascade"][small][0][0])
        out += [(f"lenience 4 on MaG drafts [{small}] K={K}", "off",
                 dict(drafters=small, kmatrix=K, lenience=4.0, mag_lenience="off"),
                 "on", dict(drafters=small, kmatrix=K, lenience=4.0, mag_lenience="on")),
                (f"MaG occurrence [{small}] K={K}", "first, uncapped",
                 dict(drafters=f"{neural[-1]},{PAPER_MAG}", kmatrix=K), "recent, capped at 24",
                 dict(drafters=small, kmatrix=K))]
    return out


def variant_name(opts: dict) -> str:
    return "variant cs_drafting " + " ".join(f"{k}={v}" for k, v in opts.items())


def compare_pairs(pairs, by: dict) -> list[dict]:
    """One row per variant: the paper's setting and ours side by side, measured on the same prompts."""
    out = []
    for variant, paper_set, paper, ours_set, ours in pairs:
        p, o = by[variant_name(paper)], by[variant_name(ours)]
        out.append(dict(variant=variant, paper=paper_set, ours=ours_set,
                        paper_tok_s=p["tokens_per_s"], ours_tok_s=o["tokens_per_s"],
                        ours_vs_paper=round(o["tokens_per_s"] / p["tokens_per_s"], 3) if p["tokens_per_s"] else None,
                        paper_acc_call=p.get("accepted_per_call"), ours_acc_call=o.get("accepted_per_call"),
                        paper_swi=p.get("swi_latency"), ours_swi=o.get("swi_latency")))
    return out


def goals(table: list[dict]) -> list[str]:
    """The issue's benchmark goals, evaluated on one temperature's table (measured, met or not)."""
    by = {r["name"]: r for r in table}
    best = lambda pre, key="tokens_per_s": max((r for n, r in by.items() if n.startswith(pre)),  # noqa: E731
                                               key=lambda r: r.get(key) or 0, default=None)
    out = []
    cs, peer = best("cs_drafting"), max((r for n, r in by.items() if n.startswith("hf ")),
                                        key=lambda r: r["tokens_per_s"], default=None)
    if cs and peer:
        out.append(f"goal CS >= 1.3x best HF peer tokens/s: {cs['tokens_per_s']:.1f} vs {peer['tokens_per_s']:.1f} "
                   f"({peer['name']}) = {cs['tokens_per_s'] / peer['tokens_per_s']:.2f}x "
                   f"-> {'met' if cs['tokens_per_s'] >= 1.3 * peer['tokens_per_s'] else 'NOT met'}")
    cs_swi, sp_swi = best("cs_drafting", "swi_params"), best("speculative", "swi_params")
    if cs_swi and sp_swi:
        r = cs_swi["swi_params"] / sp_swi["swi_params"]
        out.append(f"goal CS SWI >= 1.2x best speculative SWI: {cs_swi['swi_params']:.2f} vs {sp_swi['swi_params']:.2f} "
                   f"= {r:.2f}x -> {'met' if r >= 1.2 else 'NOT met'}")
    for name, r in by.items():
        if name.startswith("mag k="):
            k = name.split("=")[1]
            pl = by.get(f"hf prompt-lookup k={k}")
            if pl:
                out.append(f"goal MaG >= prompt lookup at k={k}: {r['tokens_per_s']:.1f} vs {pl['tokens_per_s']:.1f} "
                           f"-> {'met' if r['tokens_per_s'] >= pl['tokens_per_s'] else 'NOT met'}")
    pp, sp = best("specdec_pp"), best("speculative")
    if pp and sp:
        out.append(f"goal SpecDec++ >= best fixed-k speculative tokens/s: {pp['tokens_per_s']:.1f} vs "
                   f"{sp['tokens_per_s']:.1f} ({sp['name']}) -> {'met' if pp['tokens_per_s'] >= sp['tokens_per_s'] else 'NOT met'}")
    return out
