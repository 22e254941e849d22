"""``specserve tune`` and the ``cs`` suite's choices: measure acceptance and costs, predict, rank.

Acceptance alpha(reviewer, drafter) per pair (:func:`cluster.bench.measure.measure_alphas`) and, for Max-Gram
proposals, per position (:func:`measure_mag_positions`: a proposal copies a matched run, so its tokens are not
independent); one-row forward costs by tokens fed (:func:`measure_forward`, a
:class:`cluster.core.forward_cost.ForwardCost` table) and the engine's own work per step and per draft token
(:func:`measure_overhead`).  Times are this process's CPU time (single-threaded torch: the work itself); on a
shared machine wall time adds whatever else ran, which made the tables too noisy to rank near-equal K-matrices.  The prediction is
the EWIF of Chen et al., *Cascade Speculative Drafting for Even Faster LLM Inference*, section 4, with every
forward charged by its length (:func:`cluster.core.cost_model.predict_cascade`); the paper's per-call model (one
unit per model run, i.i.d. acceptance) is kept beside it for comparison.
"""
from __future__ import annotations

import statistics
import time

import torch

from cluster.bench.measure import measure_alphas, measure_costs
from cluster.bench.report import print_table
from cluster.core.cost_model import ranked_cascades
from cluster.core.forward_cost import ForwardCost, best_k
from cluster.core.sampling import SamplingParams, logits_to_probs
from cluster.engine.request import GenerationRequest

TUNE_TOKENS = (1, 2, 4, 8, 16, 32)


def measure_forward(engine, names: list[str], prompt: list[int], iters: int = 25) -> dict[str, ForwardCost]:
    """One-row forward costs by tokens fed, ``{model: ForwardCost}`` over rows (1,) x :data:`TUNE_TOKENS`,
    for the neural models among ``names``: a ``score`` of t - 1 draft tokens after ``prompt``.  The sizes are interleaved round by round and the median taken, so a burst of load on a
    shared machine spreads over every size instead of inflating one; made non-decreasing in tokens."""
    out = {}
    for name in names:
        h = engine.models[name]
        if getattr(h, "deterministic", False) or not hasattr(h, "score"):
            continue
        ids = list(prompt)[-(h.max_length - max(TUNE_TOKENS) - 1):]
        h.prefill("tune-fwd", ids, SamplingParams(0.0), 0)
        times: dict[int, list[float]] = {t: [] for t in TUNE_TOKENS}
        try:
            for it in range(iters + 1):                               # round 0 warms up
                for t in TUNE_TOKENS:
                    t0 = time.process_time()
                    h.score("tune-fwd", ids[:t - 1] if len(ids) >= t - 1 else [0] * (t - 1))
                    if it:
                        times[t].append(time.process_time() - t0)
                    h.rollback("tune-fwd", len(ids))
        finally:
            h.release("tune-fwd")
        out[name] = ForwardCost({(1, t): statistics.median(v) for t, v in times.items()}).monotone()
    return out


def measure_overhead(engine, mag: str, prompt: list[int], sampling, k: int = 8, tokens: int = 48,
                     rounds: int = 5, reps: int = 5) -> tuple[float, float]:
    """(seconds per step, seconds per draft token) of the engine's own work beyond the target's forwards: each
    round times autoregressive decoding (a step = target(1, 1) + o) and Max-Gram drafting k tokens a step (a step
    = target(1, L + 1) + o + eps * L) and, right after, the bare target forwards of 1 and L + 1 tokens (medians of
    ``reps``), so load that drifts between rounds cancels; medians over rounds, prefill subtracted."""
    target = engine.models[engine.target]
    target.prefill("tune-oh", list(prompt), SamplingParams(0.0), 0)

    def forward(t: int) -> float:
        times = []
        for _ in range(reps):
            t0 = time.process_time()
            target.score("tune-oh", list(prompt[:t - 1]))
            times.append(time.process_time() - t0)
            target.rollback("tune-oh", len(prompt))
        return statistics.median(times)

    os, eps = [], []
    try:
        for _ in range(rounds):
            step = {}
            for strategy, opts in (("autoregressive", {}), ("mag", {"k": k})):
                t0 = time.process_time()
                res = engine.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=tokens, sampling=sampling,
                                                        seed=0, strategy=strategy, options=opts, ignore_eos=True))
                step[strategy] = (time.process_time() - t0, max(1, res.stats.target_forwards),
                                  res.stats.drafted_tokens)
            prefill = forward(len(prompt))                              # one pass over the prompt
            per_step = {name: (sec - prefill) / n for name, (sec, n, _) in step.items()}
            L = step["mag"][2] / step["mag"][1]
            o = per_step["autoregressive"] - forward(1)
            os.append(o)
            if L > 0:
                eps.append((per_step["mag"] - forward(round(L) + 1) - o) / L)
    finally:
        target.release("tune-oh")
    return max(0.0, statistics.median(os)), max(0.0, statistics.median(eps)) if eps else 0.0


def measure_mag_positions(engine, reviewers: list[str], mag: str, prompts: list[list[int]], sampling,
                          n_tokens: int = 48, k: int = 12, seed: int = 0,
                          prior: float = 8.0) -> tuple[dict, dict]:
    """Per-position acceptance of Max-Gram proposals, ``{(reviewer, mag): [alpha_1, ..., alpha_k]}`` with
    alpha_t = P(t-th proposed token accepted | the t - 1 before it were): at every position of target
    continuations of ``prompts`` (teacher-forced), MaG proposes k tokens and each reviewer scores them in one
    pass; a token is accepted with probability p_r(x) (its greedy indicator at temperature 0).  Later positions
    are reached rarely, so alpha_t (t >= 2) is shrunk towards the pooled rate of all t >= 2 with weight
    ``prior``: (reached_t + prior * pooled) / (reached_{t-1} + prior).

    Second result, ``{(reviewer, drafter): v}`` for reviewers above a neural drafter (``reviewers`` largest
    first): the rate at which the reviewer accepts the MaG tokens the drafter accepted (its vouched tokens,
    :class:`cluster.core.cost_model.CascadeModel`)."""
    h = engine.models[mag]
    reach = {r: [0.0] * (k + 1) for r in reviewers}          # sum over positions of P(first t accepted)
    pairs = [(r, m) for i, r in enumerate(reviewers) for m in reviewers[i + 1:]]
    vouch = {pair: [0.0, 0.0] for pair in pairs}              # (sum P(m accepted) P(r accepts), sum P(m accepted))
    for i, ids in enumerate(prompts):
        res = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=n_tokens, sampling=sampling,
                                                seed=seed + i, strategy="autoregressive", ignore_eos=True))
        seq = list(ids) + res.token_ids
        h.prefill("tune-pos", list(ids), sampling, 0)
        try:
            for t in range(len(ids), len(seq)):
                draft, _ = h.propose("tune-pos", k)
                h.rollback("tune-pos", t)
                accs = {}
                for r in reviewers:
                    with torch.inference_mode():
                        logits = engine.models[r].model(input_ids=torch.tensor([seq[:t] + draft])).logits[0, t - 1:-1]
                    p = logits_to_probs(logits.float(), sampling)                      # [k, V]
                    accs[r] = acc = p[torch.arange(k), torch.tensor(draft)].tolist()
                    prod = 1.0
                    for j, a in enumerate(acc, 1):
                        prod *= a
                        reach[r][j] += prod
                    reach[r][0] += 1.0
                for r, m in pairs:
                    prod = 1.0
                    for am, ar in zip(accs[m], accs[r]):
                        prod *= am
                        vouch[(r, m)][0] += prod * ar
                        vouch[(r, m)][1] += prod
                h.extend("tune-pos", [seq[t]])
        finally:
            h.release("tune-pos")
    out = {}
    for r in reviewers:
        n = reach[r]
        pooled = sum(n[2:]) / sum(n[1:-1]) if sum(n[1:-1]) > 0 else 0.0
        out[(r, mag)] = [n[1] / n[0] if n[0] else 0.0] + [(n[j] + prior * pooled) / (n[j - 1] + prior)
                                                          for j in range(2, k + 1)]
    return out, {pair: a / n for pair, (a, n) in vouch.items() if n > 0}


def neural_drafters(engine, cfg) -> list[str]:
    """The config's neural drafters, largest first."""
    return sorted((d for d in cfg.drafters if d in engine.models),
                  key=lambda d: -engine.models[d].num_params)


def cascade_lists(neural: list[str], mag: str) -> list[list[str]]:
    out = [[mag]]
    if neural:
        out.append([neural[-1], mag])
    if len(neural) >= 2:
        out += [[neural[0], mag], [neural[0], neural[-1], mag]]
    return out


def tune_choices(engine, cfg, sampling, prompts, *, n_tokens: int = 48, log=print) -> dict:
    """Measure alpha for every (reviewer, drafter) pair, a per-call latency for every model and one-row forward
    costs by tokens fed for the neural ones, then pick k for plain speculation and the K-matrix of every
    cascade list maximising the predicted EWIF with every forward charged by its length (``speculative``,
    ``cascade``); ``*_per_call`` hold the choices of the paper's per-call cost model (one unit per run of a
    model, whatever the draft length; Chen et al., CS Drafting, section 4) for comparison."""
    mag = cfg.mag.name
    neural = neural_drafters(engine, cfg)
    names = [engine.target, *neural, mag]
    t0 = time.perf_counter()
    alphas = measure_alphas(engine, names, prompts, sampling, n_tokens)
    costs = measure_costs(engine, names, prompts[0])
    forward = measure_forward(engine, names, prompts[0])
    overhead = measure_overhead(engine, mag, prompts[0], sampling)
    by_position, vouched = measure_mag_positions(engine, names[:-1], mag, prompts, sampling, n_tokens=n_tokens)
    positional = {**alphas, **by_position}
    out = {"alphas": alphas, "costs": costs, "forward": forward, "overhead": overhead, "positional": positional,
           "vouched": vouched, "speculative": {}, "cascade": {}, "speculative_per_call": {}, "cascade_per_call": {}}
    for d in neural + [mag]:
        out["speculative"][d] = best_k(d, engine.target, positional, costs, forward=forward, overhead=overhead)
        out["speculative_per_call"][d] = best_k(d, engine.target, alphas, costs)
    for lst in cascade_lists(neural, mag):
        out["cascade"][",".join(lst)] = ranked_cascades(lst, engine.target, positional, costs, (mag,),
                                                        forward=forward, overhead=overhead, vouched=vouched)
        out["cascade_per_call"][",".join(lst)] = ranked_cascades(lst, engine.target, alphas, costs, (mag,))
    log(f"[tune: measured {len(names)} models on {len(prompts)} prompts in {time.perf_counter() - t0:.1f}s]")
    rows = [dict(reviewer=r, **{d: round(alphas[(r, d)], 3) for d in names[1:] if d != r}) for r in names[:-1]]
    print_table(rows, f"acceptance rate alpha(reviewer, drafter), temperature {sampling.temperature:g}")
    print_table([dict(model=n, call_ms=round(costs[n] * 1e3, 3), cost_vs_target=round(costs[n] / costs[engine.target], 4),
                      params=engine.models[n].num_params,
                      **{f"fwd_ms_t{t}": round(forward[n](1, t) * 1e3, 3) for t in TUNE_TOKENS if n in forward})
                 for n in names], "per-call cost and one-row forward cost by tokens fed")
    log(f"[tune: engine overhead {overhead[0] * 1e3:.3f} ms per step + {overhead[1] * 1e3:.3f} ms per draft token]")
    print_table([dict(reviewer=r, **{f"a{t + 1}": round(a, 3) for t, a in enumerate(positional[(r, mag)][:8])})
                 for r in names[:-1]], f"{mag}: acceptance of its t-th proposed token given the ones before it")
    print_table([dict(reviewer=r, drafter=m, alpha_own=round(alphas[(r, m)], 3), vouched_mag=round(v, 3))
                 for (r, m), v in vouched.items()], "acceptance of a drafter's own tokens vs of MaG tokens it accepted")
    return out
