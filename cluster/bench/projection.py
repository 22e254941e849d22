"""A projection of the served table for ``configs/production-70b.yaml``'s layout, from the cost model.

No GPU was lent to the session that wrote this, and no 70B weights can be fetched here, so the production
layout (a Llama-3.1-70B-class target over TP = 8 on one H100 node; a ~1B drafter in the draft-group actor on
its own GPU; the Max-Gram drafter beside it) is projected, not measured.  Inputs (per forward, bf16):

* target decode forward, one token, batch 1: **9 ms** -- decoding is bound by reading the weights: 141 GB over
  8 GPUs is 17.6 GB per H100 at 3.35 TB/s = 5.3 ms at full bandwidth (Austin et al., *How to Scale Your Model*,
  "Serving LLaMA 3-70B"), ~60 % of peak in practice plus 2 all-reduces per layer over NVLink;
* verifying k + 1 = 5 tokens costs **1.05x** one token (still weight-bound: 5 x rows tokens stay far below the
  H100's ~300 tokens of critical batch), and batch 32 costs **1.4x** batch 1 (KV reads grow with rows);
* drafter forward (~1B, one GPU): **2 ms** (launch-bound at this size: 16 layers of small kernels);
* one Ray actor round trip: **1 ms** (0.6 ms measured here, docs/cluster.md), drafts as token ids (8 B each);
* acceptance per token **0.8** for drafter-large (a 70B/1B pair of one family; nano-PEARL and SwiftSpec report
  multi-x speedups at batch 1 on such pairs), 0.5 for the Max-Gram drafter.

What a GPU run has to confirm: the target's cost curve in tokens and rows (``specserve bench --suite served``
on the production config measures it through the planner's start-up grid), the drafter's launch-bound cost,
the round trip through Ray between GPU nodes, the pre-draft hit rate, and the acceptance rates.
"""
from __future__ import annotations

from cluster.core.cost_model import expected_tokens

INPUTS = dict(target_ms=9.0, verify_factor=1.05, batch32_factor=1.4, draft_ms=2.0, rtt_ms=1.0,
              alpha_drafter=0.8, alpha_mag=0.5, k=4)


def project(inputs: dict = INPUTS) -> list[dict]:
    """Rows (strategy, batch, tokens/s per request stream, ratio to autoregressive): synchronous speculative
    decoding, the same with the next block pre-drafted during verification (PEARL's post-verify: a hit when the
    whole block and the guessed bonus token are accepted, probability alpha^(k+1)), and Max-Gram drafting."""
    i = dict(INPUTS, **inputs)
    k, rtt = i["k"], i["rtt_ms"]
    rows = []
    for batch, scale in ((1, 1.0), (32, i["batch32_factor"])):
        target1 = i["target_ms"] * scale
        verify = target1 * i["verify_factor"]
        e_dl, e_mag = expected_tokens(i["alpha_drafter"], k), expected_tokens(i["alpha_mag"], k)
        hit = i["alpha_drafter"] ** (k + 1)
        draft = k * i["draft_ms"] * (1.0 if batch == 1 else 1.2)        # a batched drafter forward
        steps = {"autoregressive": (target1, 1.0),
                 "speculative (sync)": (draft + rtt + verify, e_dl),
                 "speculative (pre-drafted)": (verify + rtt + (1.0 - hit) * draft, e_dl),
                 "mag": (verify + rtt, e_mag)}
        base = 1000.0 / target1
        for name, (ms, tokens) in steps.items():
            rate = 1000.0 * tokens / ms
            rows.append(dict(strategy=name, batch=batch, step_ms=round(ms, 2), tokens_per_step=round(tokens, 2),
                             tok_s_per_stream=round(rate, 1), vs_autoregressive=round(rate / base, 2)))
    return rows
