"""Benchmark suites of the verification family: ``verify`` (block vs token) and ``cascades``.

``specserve bench --suite verify``: speculative sampling at temperature 1 with every neural drafter
and L in {4, 6, 8}; token and block verification side by side, interleaved prompt by prompt with the
same seeds.  Besides the realised accepted tokens per target call, every verification step records
both verifiers' expected accepted length on the very same draft (token: E[accepted | draft] =
sum_i prod_{j<=i} min(1, p_j/q_j); block: sum_i p_i, whose mean over drafts from the drafter is E[tau],
Sun et al., *Optimal Block-Level Draft Verification for Accelerating Speculative Decoding*)
-- a paired estimate free of the verifiers' own coin flips.

The same suite puts GenSpecSample's two published bonus tokens side by side (Narasimhan et al., *Faster
Cascades via Speculative Decoding*, Algorithm 4): from p (the first version; our default) and from pi (the
later version; one more drafter forward per fully accepted draft), for the OPT speculative cascade at
alpha = :data:`BONUS_ALPHA` with every drafter and L: accepted tokens per target call, drafter forwards per
token and tokens/s (quality: the cascades suite).

``specserve bench --suite cascades``: cost-quality curves at temperature 1.  Every speculative cascade
rule, lossy speculative sampling, the sequential TokenCascade[Chow] and the oracle Diff cascade
(reference) swept over alpha; x = latency
relative to the target alone (walltime; target calls per token; and a parameter-count cost model
(target calls + drafter calls * n_drafter / n_target) per token), y = chrF (sacrebleu) of the
completions against the held-out files' true continuations.  Writes a PNG plot and a CSV/JSON table.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch

from cluster.bench.report import Row, print_table, write_results
from cluster.core.block_verify import block_weights
from cluster.core.sampling import SamplingParams
from cluster.core.verifiers import VERIFIERS
from cluster.engine.request import GenerationRequest
from cluster.errors import check_int
from cluster.family.corpus import heldout_prompts
from cluster.local import build_engine

VERIFY_LS = (4, 6, 8)
BONUS_ALPHA = 0.3


T1 = SamplingParams(1.0)


def _threads() -> int:
    """Intra-op threads for these suites (``SPECSERVE_THREADS``, default 1; see cli.configure_threads).

    On a shared CPU a 2-thread pool stalls whenever its second worker is descheduled, and that
    penalises strategies that issue many small ops far more than plain decoding; one thread keeps
    the rows' walltimes comparable.
    """
    n = check_int("SPECSERVE_THREADS", os.environ.get("SPECSERVE_THREADS", "1"), 1, 256)
    torch.set_num_threads(n)
    return n


def _prompts(engine, n: int) -> list[dict]:
    return heldout_prompts(engine.tokenizer, n)


def _run(engine, strategy: str, options: dict, sampling: SamplingParams, max_new: int, ids, seed, row: Row):
    t0 = time.perf_counter()
    res = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=max_new, sampling=sampling, seed=seed,
                                            strategy=strategy, options=options, ignore_eos=True))
    row.record(res.stats, time.perf_counter() - t0)
    return res


def expected_accepted(draft: list[int], q: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """(token, block) per-draft estimates of the expected accepted length; unbiased for drafts drawn
    from the drafter (token's is exact given the draft; block's sum_i p_i has mean E[tau])."""
    L = len(draft)
    if L == 0:
        return 0.0, 0.0
    idx = torch.tensor(draft)
    pb = p[:L].to(torch.float64).gather(-1, idx[:, None])[:, 0]
    qs = q.to(torch.float64).gather(-1, idx[:, None])[:, 0]
    ratio = torch.where(qs > 0, pb / torch.where(qs > 0, qs, 1.0), torch.ones_like(pb)).clamp(max=1.0)
    token = float(torch.cumprod(ratio, 0).sum())
    block = float(block_weights(draft, q, p)[0][1:].sum())
    return token, block


def run_verify(args, cfg) -> int:
    threads = _threads()
    # the per-row reference sampler: this suite records each verification's (q, p) rows, which the batched
    # sampler never brings to the host
    engine = build_engine(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, sampler="reference")))
    n = check_int("prompts", args.prompts, 1, 256)
    max_new = check_int("max_new_tokens", args.max_new_tokens, 1, cfg.engine.max_new_tokens_limit)
    prompts = [p["prompt_ids"] for p in _prompts(engine, n)]
    drafters = [d for d in cfg.drafters if d in engine.models and hasattr(engine.models[d], "propose")
                and getattr(engine.models[d], "num_params", 0)]
    rows: dict[tuple, Row] = {}
    expect: dict[tuple, list[float]] = {}        # key -> [sum token E, sum block E, calls]
    current: list = [None]
    originals = dict(VERIFIERS)

    def recording(name):
        fn = originals[name]

        def verify(draft, q, p, rng):
            if current[0] is not None and draft:
                tok, blk = expected_accepted(draft, q, p)
                acc = expect.setdefault(current[0], [0.0, 0.0, 0])
                acc[0] += tok
                acc[1] += blk
                acc[2] += 1
            return fn(draft, q, p, rng)
        return verify

    configs = [(d, L, v) for d in drafters for L in VERIFY_LS for v in ("token", "block")]
    try:
        for name in ("token", "block"):
            VERIFIERS[name] = recording(name)
        for d, L, v in configs:                                               # warm-up (not timed)
            _run(engine, "speculative", {"drafter": d, "k": L, "verify": v}, T1, 8, prompts[0][:16], 0, Row("w"))
        for i, ids in enumerate(prompts):
            order = configs if i % 2 == 0 else configs[::-1]                   # alternate to cancel drift
            for d, L, v in order:
                key = (d, L, v)
                current[0] = key
                _run(engine, "speculative", {"drafter": d, "k": L, "verify": v}, T1, max_new, ids, 1000 + i,
                     rows.setdefault(key, Row(f"{d} L={L} {v}")))
                current[0] = None
    finally:
        VERIFIERS.update(originals)

    table = []
    for d in drafters:
        for L in VERIFY_LS:
            t, b = rows[(d, L, "token")], rows[(d, L, "block")]
            et, eb = expect.get((d, L, "token"), [0, 0, 1]), expect.get((d, L, "block"), [0, 0, 1])
            # paired expectation: both verifiers' E[accepted] on all drafts seen in either run
            e_tok = (et[0] + eb[0]) / max(1, et[2] + eb[2])
            e_blk = (et[1] + eb[1]) / max(1, et[2] + eb[2])
            table.append(dict(
                drafter=d, L=L,
                token_acc_per_call=round(t.accepted_per_call, 3), block_acc_per_call=round(b.accepted_per_call, 3),
                measured_gain_pct=round(100 * (b.accepted_per_call / t.accepted_per_call - 1), 2)
                if t.accepted_per_call else None,
                token_E_acc=round(e_tok, 4), block_E_acc=round(e_blk, 4),
                expected_gain_pct=round(100 * (e_blk / e_tok - 1), 2) if e_tok else None,
                token_tok_s=round(t.tokens_per_s, 2), block_tok_s=round(b.tokens_per_s, 2),
                speed_ratio=round(b.tokens_per_s / t.tokens_per_s, 3) if t.tokens_per_s else None,
                steps=t.steps + b.steps))
    title = (f"verify: block vs token verification, temperature 1, {len(prompts)} held-out prompts x {max_new} "
             f"tokens, config {cfg.source}, {threads} thread(s)")
    print_table(table, title)
    print("acc_per_call = realised accepted draft tokens per target call; E_acc = expected accepted tokens of "
          "each verifier on the same drafts (paired); tok_s = generated tokens per second")
    write_results(table, Path(args.out), "bench_verify")
    bonus = bonus_table(engine, drafters, prompts, max_new)
    print_table(bonus, f"verify: GenSpecSample bonus token from pi (later version) vs p (first version; ours), "
                       f"spec_cascade rule opt alpha {BONUS_ALPHA}, same prompts and seeds")
    write_results(bonus, Path(args.out), "bench_verify_bonus")
    print(f"results written to {Path(args.out) / 'bench_verify'}{{,_bonus}}.{{csv,json}}")
    return 0


def bonus_table(engine, drafters: list[str], prompts: list[list[int]], max_new: int) -> list[dict]:
    rows: dict[tuple, Row] = {}
    configs = [(d, L, b) for d in drafters for L in VERIFY_LS for b in ("pi", "p")]
    opts = lambda d, L, b: {"drafter": d, "k": L, "rule": "opt", "alpha": BONUS_ALPHA, "bonus": b}  # noqa: E731
    for d, L, b in configs:                                                   # warm-up (not timed)
        _run(engine, "spec_cascade", opts(d, L, b), T1, 8, prompts[0][:16], 0, Row("w"))
    for i, ids in enumerate(prompts):
        for d, L, b in (configs if i % 2 == 0 else configs[::-1]):
            _run(engine, "spec_cascade", opts(d, L, b), T1, max_new, ids, 3000 + i,
                 rows.setdefault((d, L, b), Row(f"{d} L={L} {b}")))
    out = []
    for d in drafters:
        for L in VERIFY_LS:
            p, o = rows[(d, L, "pi")], rows[(d, L, "p")]
            out.append(dict(drafter=d, L=L, paper_pi_acc_call=round(p.accepted_per_call, 3),
                            ours_p_acc_call=round(o.accepted_per_call, 3),
                            paper_pi_draft_calls_tok=round(p.draft_calls / p.tokens, 3),
                            ours_p_draft_calls_tok=round(o.draft_calls / o.tokens, 3),
                            paper_pi_tok_s=round(p.tokens_per_s, 2), ours_p_tok_s=round(o.tokens_per_s, 2),
                            ours_vs_paper=round(o.tokens_per_s / p.tokens_per_s, 3) if p.tokens_per_s else None))
    return out
