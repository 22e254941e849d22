"""Measurements behind ``specserve tune`` and the benchmarks: pairwise acceptance rates alpha(reviewer,
drafter), per-model call costs, batched forward costs by rows and tokens, and Max-Gram proposal latency at
several context lengths."""
from __future__ import annotations

import random
import statistics
import time
import time as _time
from typing import Sequence

import numpy as np
import torch

from cluster.core.calls import PrefillItem, Score, run_group
from cluster.core.sampling import SamplingParams, logits_to_probs
from cluster.engine.request import GenerationRequest
from cluster.models.maxgram import MagHandle


# -- `specserve tune`: measure, predict, choose ------------------------------------------------------
def measure_alphas(engine, names: list[str], prompts: list[list[int]], sampling, n_tokens: int = 48,
                   seed: int = 0) -> dict[tuple[str, str], float]:
    """alpha(reviewer, drafter) for every ordered pair of served models (reviewer != drafter):
    on target continuations of ``prompts`` (teacher-forced), the mean of sum_x min(p_r(x), q_d(x))
    (temperature > 0; the exact acceptance probability of speculative sampling) or of
    [argmax p_r == argmax q_d] (greedy).  MaG's q is the one-hot of its prediction."""

    sums: dict[tuple[str, str], float] = {}
    count = 0
    for i, ids in enumerate(prompts):
        res = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=n_tokens, sampling=sampling,
                                                seed=seed + i, strategy="autoregressive", ignore_eos=True))
        seq, L = ids + res.token_ids, len(res.token_ids)
        dists = {}
        for name in names:
            h = engine.models[name]
            if getattr(h, "deterministic", False):
                h.prefill("tune", ids, sampling, 0)
                logits = h.score("tune", res.token_ids)[:-1]                        # [L, V]
                h.release("tune")
            else:
                with torch.inference_mode():
                    logits = h.model(input_ids=torch.tensor([seq])).logits[0, len(ids) - 1:-1].float()
            dists[name] = logits_to_probs(logits, sampling)                         # [L, V]
        for r in names:
            for d in names:
                if r != d:
                    a = torch.minimum(dists[r], dists[d]).sum(-1).sum()
                    sums[(r, d)] = sums.get((r, d), 0.0) + float(a)
        count += L
    return {k: v / max(1, count) for k, v in sums.items()}


def measure_costs(engine, names: list[str], prompt: list[int], iters: int = 15) -> dict[str, float]:
    """Median seconds of one call per model: a 1-token forward with KV cache for neural models (the
    target: scoring a 4-token draft), one 4-token proposal for MaG."""

    out = {}
    for name in names:
        h = engine.models[name]
        h.prefill("cost", prompt, SamplingParams(0.0), 0)
        ts = []
        for _ in range(iters + 2):
            t0 = _time.perf_counter()
            if getattr(h, "deterministic", False):
                h.propose("cost", 4)
            elif name == engine.target:
                h.score("cost", prompt[-4:])
            else:
                h.score("cost", [])
            ts.append(_time.perf_counter() - t0)
            h.rollback("cost", len(prompt))
        h.release("cost")
        out[name] = statistics.median(ts[2:])
    return out


def forward_cost_grid(handle, rows=(1, 4, 8, 16, 32), new_tokens=(1, 5), context: int = 128,
                      iters: int = 10) -> dict[tuple[int, int], float]:
    """Wall seconds of one batched score forward through ``handle`` per (r, t) in ``rows`` x ``new_tokens``:
    r requests (ids ``__grid<i>``) with ``context`` random cached tokens each feed t tokens (the last context token
    plus a draft of t - 1).  The fastest of ``iters`` timings after one warm-up -- the minimum, not the median:
    on a shared machine a timing is the call's cost plus whatever interfered.  Every request is rolled back to
    its context after each call and released at the end."""
    gen = random.Random(0)
    result = {}
    for r in rows:
        rids = [f"__grid{i}" for i in range(r)]
        handle.prefill_batch([PrefillItem(rid, [gen.randrange(handle.vocab_size) for _ in range(context)],
                                          SamplingParams(), i) for i, rid in enumerate(rids)])
        try:
            for t in new_tokens:
                calls = [(rid, Score(handle.name, (1,) * (t - 1))) for rid in rids]
                times = []
                for it in range(iters + 1):                  # one warm-up
                    t0 = time.perf_counter()
                    run_group(handle, Score, calls)          # one batched call (or per request)
                    if it:
                        times.append(time.perf_counter() - t0)
                    for rid in rids:
                        handle.rollback(rid, context)
                result[(r, t)] = min(times)
        finally:
            for rid in rids:
                handle.release(rid)
    return result


def proposal_latency(handle: MagHandle, sizes: Sequence[int] = (256, 1024, 4096), k: int = 8,
                     iters: int = 200, seed: int = 0) -> dict[int, float]:
    """Median microseconds of one ``propose(k)`` + ``rollback`` at each context length (random
    repetitive token sequences, so matches are found)."""
    rng = np.random.default_rng(seed)
    out = {}
    for n in sizes:
        base = rng.integers(0, handle.vocab_size, size=max(8, n // 8)).tolist()
        ids = (base * (n // len(base) + 1))[:n]
        for i in range(0, n, 7):                       # perturb so matches have varying lengths
            ids[i] = int(rng.integers(0, handle.vocab_size))
        rid = f"latency-{n}"
        handle.prefill(rid, ids)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            handle.propose(rid, k)
            handle.rollback(rid, n)
            times.append(time.perf_counter() - t0)
        handle.release(rid)
        out[n] = float(np.median(times) * 1e6)
    return out


# -- text quality ---------------------------------------------------------------------------------------
def has_loop(token_ids: Sequence[int], n: int = 4, times: int = 3) -> bool:
    """True when some ``n``-gram of ``token_ids`` occurs ``times`` or more times (overlaps counted): the
    degenerate repetition (``re_re_re_re...``) that small greedy LMs fall into."""

    counts: dict[tuple[int, ...], int] = {}
    for i in range(len(token_ids) - n + 1):
        g = tuple(token_ids[i:i + n])
        counts[g] = counts.get(g, 0) + 1
        if counts[g] >= times:
            return True
    return False


def drafting_rows(cfg, engine) -> list[tuple[str, str, dict]]:
    """(row name, strategy, options) that the suites compare: autoregressive first, then speculative with the
    config's drafter (k = 4), and mag and cs_drafting where the config serves the Max-Gram drafter."""
    rows = [("autoregressive", "autoregressive", {})]
    drafter = cfg.engine.options.get("drafter") or next(iter(cfg.drafters), None)
    if drafter in engine.models:
        rows.append((f"speculative {drafter} k=4", "speculative", {"drafter": drafter, "k": 4}))
    if cfg.mag is not None:
        rows += [("mag k=4", "mag", {"k": 4}), ("cs_drafting", "cs_drafting", {})]
    return rows
