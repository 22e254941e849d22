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
from cluster.engine.request import GenerationRequest
from cluster.errors import check_int
from cluster.family.bigram import ensure_bigram
from cluster.local import build_engine


def with_mag(cfg):
    """``cfg`` with the Max-Gram drafter served (config section ``mag``), added if absent, and its
    bigram table built if missing (callers are entry points)."""
    cfg = cfg if cfg.mag is not None else dataclasses.replace(cfg, mag=MagSpec())
    ensure_bigram(cfg)
    return cfg


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
    engine = build_engine(cfg)
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
    print(f"results written to {out_dir}/bench_cs_t{{0,1}}.{{csv,json}} and acceptance_by_position_t*.png")
    return 0
