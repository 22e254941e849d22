"""A projection of the served table for ``configs/production-70b.yaml``'s layout, by the served-step simulation
(:mod:`cluster.bench.simulate`, checked against this machine's served table first: ``--suite simulate``).

No 70B weights can be fetched here, so the production layout (a Llama-3.1-70B-class target over TP = 8 on
one GPU node; a ~1B drafter in the draft-group actor on its own GPU; the Max-Gram drafter beside it) is
projected.  Its forward costs were MEASURED on a lent NVIDIA H200 (2026-11-26, ``specserve bench --suite gpu``:
:mod:`cluster.bench.gpu_shapes`, the same shapes with random bf16 weights, transformers 5.23 eager, as the
engine runs them, 512 cached positions per row); the rest is cited:

* target decode forward, one token, batch 1: **44.8 ms** -- one TP rank's forward measured 42.4 ms, plus
  2.4 ms of all-reduces (2 per layer, ~15 us each on NVLink: cited in :mod:`cluster.bench.gpu_shapes`).  Eager
  transformers is bound by launching kernels, not by reading weights (17.6 GB per rank would take ~4 ms at the
  H200's 4.8 TB/s): replayed from a CUDA graph, the same forward took 14.2 ms.  The cited weight-bound estimate
  this replaces was 9 ms;
* verifying k + 1 = 5 tokens costs **1.14x** one token, and batch 32 costs **1.09x** batch 1 (measured);
* drafter forward (~1B, one GPU): **9.3 ms**, and 0.94x that at 32 rows (measured: 16 layers of launch-bound
  eager kernels; 2.5 ms from a CUDA graph);
* one Ray actor round trip: **1 ms** (0.6 ms measured here, docs/cluster.md), drafts as token ids (8 B each);
* acceptance per token **0.8** for drafter-large (a 70B/1B pair of one family; nano-PEARL and SwiftSpec report
  multi-x speedups at batch 1 on such pairs), 0.5 for the Max-Gram drafter, i.i.d. per position;
* prompt prefill: a 64-token prompt per row, priced as one decode forward times (1 + tokens / 300): the
  forward stays weight-bound up to the H100's critical batch of ~300 tokens (Austin et al., *How to Scale Your
  Model*, "Roofline");
* the front (Serve's proxy and deployment): **2 ms** per request, about three actor hops at the 0.6 ms measured
  here; the engine's own work per step is taken as part of the target's forward.

Pre-drafting follows today's draft side: only for calls of at most ``DraftSide.MAX_ROWS`` rows.
Still to confirm on GPUs: the round trip through Ray between GPU nodes, the pre-draft hit rate and the
acceptance rates of a real 70B/1B pair (no weights here), and the served suite there (the lent machine had no
Ray; its wheel alone is over the 64 MiB a device call carries).
"""
from __future__ import annotations

from cluster.bench.simulate import Strategy, Unit, replicate
from cluster.core.forward_cost import ForwardCost

INPUTS = dict(target_ms=44.8, verify_factor=1.14, batch32_factor=1.09, draft_ms=9.3, draft_batch32_factor=0.94,
              rtt_ms=1.0, alpha_drafter=0.8, alpha_mag=0.5, k=4, prompt_tokens=64, critical_tokens=300,
              front_ms=2.0, new_tokens=128)
BATCHES = (1, 4, 16, 32)


def production_unit(i: dict) -> tuple[Unit, dict[str, Strategy]]:
    """The production layout's unit and its rows, priced by ``i`` (milliseconds as in :data:`INPUTS`)."""
    k, ms = i["k"], 1e-3
    t1, vf, b32 = i["target_ms"] * ms, i["verify_factor"], i["batch32_factor"]
    target = ForwardCost({(1, 1): t1, (1, k + 1): t1 * vf, (32, 1): t1 * b32, (32, k + 1): t1 * b32 * vf})
    drafter = ForwardCost({(1, 1): i["draft_ms"] * ms, (32, 1): i["draft_ms"] * ms * i["draft_batch32_factor"]})
    prefill = lambda rows: target(rows, 1) * (1 + rows * i["prompt_tokens"] / i["critical_tokens"])  # noqa: E731
    unit = Unit(target, prefill=prefill, front_request=i["front_ms"] * ms)
    rtt, a = i["rtt_ms"] * ms, i["alpha_drafter"]
    rows = {"autoregressive": Strategy("autoregressive"),
            "speculative (sync)": Strategy("speculative (sync)", k=k, drafter=drafter, alpha=a, separated=True,
                                           rtt=rtt),
            "speculative (pre-drafted)": Strategy("speculative (pre-drafted)", k=k, drafter=drafter, alpha=a,
                                                  separated=True, rtt=rtt, predraft=True),
            "mag": Strategy("mag", k=k, alpha=i["alpha_mag"], separated=True, rtt=rtt)}
    return unit, rows


def project(inputs: dict | None = None, batches=BATCHES, seeds: int = 8) -> list[dict]:
    """Rows (strategy, batch = closed-loop clients, mean step ms, tokens per row-step, tokens/s per stream,
    ratio to autoregressive at that batch, pre-draft hits per row-step), each a simulated cell of 4 requests per
    client of ``new_tokens`` tokens, pooled over ``seeds`` seeds."""
    i = dict(INPUTS, **(inputs or {}))
    unit, strategies = production_unit(i)
    rows = []
    for batch in batches:
        base = None
        for name, s in strategies.items():
            r = replicate(unit, s, batch, 4 * batch, i["new_tokens"], seeds)
            per_stream = r.tok_s / batch
            base = base or per_stream
            rows.append(dict(strategy=name, batch=batch, step_ms=round(r.step_ms, 2),
                             tokens_per_step=round(r.tokens_per_row_step, 2), tok_s_per_stream=round(per_stream, 1),
                             vs_autoregressive=round(per_stream / base, 2), predraft_hits=round(r.hit_rate, 2)))
    return rows


def believed(within: int | None = None, checked: int | None = None) -> str:
    """What the projection is worth, for its title: checked against this machine's served table first (``within``
    of ``checked`` drafting ratios within 10 %, ``--suite simulate --measured``), or not checked at all."""
    if checked is None:
        return ("unchecked: `specserve bench --suite simulate --measured <a served run's bench_served.json>` "
                "checks the simulation first")
    if checked and within == checked:
        return f"calibrated: all {checked} drafting ratios within 10 % of this machine's served table"
    return (f"NOT calibrated: {within} of {checked} drafting ratios within 10 % of this machine's served table, "
            f"so read it as the simulation's arithmetic on the cited inputs, not a forecast")
