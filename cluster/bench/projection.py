"""A closed-form projection of ``configs/production-70b.yaml``'s layout: tokens per second per stream of one
decode step, from per-step costs and acceptance rates.

No 70B weights can be fetched here, so the layout (a Llama-3.1-70B-class target over TP = 8, a ~1B drafter on a
GPU of its own behind one actor call per step, the Max-Gram drafter beside it) is priced, not served.  The
forward costs in :data:`INPUTS` are what ``specserve bench --suite gpu`` measures on a lent device
(:mod:`cluster.bench.gpu_shapes`: the same shapes with random bf16 weights, eager as the engine runs them, plus
the cited all-reduces); that suite reruns this projection on its own measurements.  The round trip and the
acceptance rates are cited: no 70B/1B pair can be run here.

One step over B rows with draft length k (the expected tokens: Leviathan et al. 2023, *Fast Inference from
Transformers via Speculative Decoding*, eq. 1):

    tokens per row  E = (1 - a^(k+1)) / (1 - a)            (i.i.d. acceptance a per position)
    step seconds    T = rtt + k * drafter(B, 1) + target(B, k + 1)

priced by :func:`cluster.core.forward_cost.step_seconds` (as ``specserve tune`` prices a step); the forward
tables interpolate linearly in rows between 1 and 32.  Autoregressive decoding is ``target(B, 1)`` for one token;
Max-Gram drafts for free.  Left out, alike for every row: prefill, the front and the engine's own work per step;
left out for the drafting rows: pre-drafting and the speculator topology (so the ratio to autoregressive is the
step's alone, not the served table's).
"""
from __future__ import annotations

from cluster.core.cost_model import expected_tokens
from cluster.core.forward_cost import ForwardCost, step_seconds

INPUTS = dict(
    target_ms=44.8,               # one TP = 8 rank's one-token forward at batch 1, with its all-reduces
    verify_factor=1.14,           # its k + 1 = 5-token forward over its one-token forward
    batch32_factor=1.09,          # its forward at 32 rows over 1 row
    draft_ms=9.3,                 # the ~1B drafter's one-token forward at batch 1
    draft_batch32_factor=0.94,    # ... at 32 rows over 1 row
    rtt_ms=1.0,                   # one Ray actor call to the draft side, beyond its compute (cited)
    alpha_drafter=0.8,            # acceptance per token of a 70B/1B pair of one family (cited)
    alpha_mag=0.5,                # ... of the Max-Gram drafter (cited)
    k=4)
BATCHES = (1, 4, 16, 32)


def _tables(i: dict) -> tuple[ForwardCost, ForwardCost, ForwardCost]:
    """The target's, the drafter's and the draft call's seconds by (rows, tokens) from ``i`` (ms)."""
    k, ms = i["k"], 1e-3
    t1, vf, b32 = i["target_ms"] * ms, i["verify_factor"], i["batch32_factor"]
    target = ForwardCost({(1, 1): t1, (1, k + 1): t1 * vf, (32, 1): t1 * b32, (32, k + 1): t1 * b32 * vf})
    drafter = ForwardCost({(1, 1): i["draft_ms"] * ms, (32, 1): i["draft_ms"] * ms * i["draft_batch32_factor"]})
    return target, drafter, ForwardCost({(1, 1): i["rtt_ms"] * ms})


def project(inputs: dict | None = None, batches=BATCHES) -> list[dict]:
    """One row per (batch, strategy): mean step ms, expected tokens per row-step, tokens/s per stream and its
    ratio to autoregressive at that batch.  ``inputs`` replaces any of :data:`INPUTS` (others are refused)."""
    unknown = set(inputs or {}) - set(INPUTS)
    if unknown:
        raise ValueError(f"projection: unknown inputs {sorted(unknown)}; known: {sorted(INPUTS)}")
    i = dict(INPUTS, **(inputs or {}))
    k = int(i["k"])
    target, drafter, call = _tables(i)
    rows = []
    for batch in batches:
        steps = {"autoregressive": (target(batch, 1), 1.0),
                 "speculative": (step_seconds(k, drafter, target, batch, call_cost=call),
                                 expected_tokens(i["alpha_drafter"], k)),
                 "mag": (step_seconds(k, None, target, batch, call_cost=call), expected_tokens(i["alpha_mag"], k))}
        base = 1.0 / steps["autoregressive"][0]
        for name, (seconds, tokens) in steps.items():
            rows.append(dict(strategy=name, batch=batch, step_ms=round(1e3 * seconds, 2),
                             tokens_per_step=round(tokens, 3), tok_s_per_stream=round(tokens / seconds, 1),
                             vs_autoregressive=round(tokens / seconds / base, 3)))
    return rows
