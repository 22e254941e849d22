"""Serving metrics through Ray's metrics API (exported by Ray's Prometheus endpoint).

Speculative-decoding counters are named as vLLM's (``vllm:spec_decode_*``, without the prefix):
drafts (verification steps), drafted tokens, accepted tokens, and accepted tokens per draft position;
plus requests by outcome and latency histograms (time to first token, time per output token,
end-to-end).  Every series is labelled by strategy.

Labels only ever take validated values (a registered strategy name, else ``invalid``; a known outcome),
so a client cannot create series or break the exporter with a name of its choosing; and recording never
raises into a request.
"""
from __future__ import annotations

import logging

from cluster.errors import shown
from cluster.strategies import REGISTRY

LATENCY_BOUNDS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0]


TPOT_BOUNDS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


OUTCOMES = ("ok", "cancelled", "invalid", "overloaded", "unauthenticated", "error", "deadline")


INVALID_LABEL = "invalid"


log = logging.getLogger("specserve.metrics")


def strategy_label(strategy) -> str:
    """The metric label of a strategy name: itself if registered, else ``invalid``."""
    return strategy if isinstance(strategy, str) and strategy in REGISTRY else INVALID_LABEL


class Metrics:
    def __init__(self):
        from ray.util.metrics import Counter, Histogram
        s = ("strategy",)
        self.drafts = Counter("spec_decode_num_drafts_total", "verification steps", tag_keys=s)
        self.draft_tokens = Counter("spec_decode_num_draft_tokens_total", "drafted tokens", tag_keys=s)
        self.accepted = Counter("spec_decode_num_accepted_tokens_total", "accepted draft tokens", tag_keys=s)
        self.accepted_pos = Counter("spec_decode_num_accepted_tokens_per_pos_total",
                                    "accepted draft tokens by draft position (0-based)",
                                    tag_keys=("strategy", "position"))
        self.requests = Counter("specserve_requests_total", "requests by outcome", tag_keys=("strategy", "outcome"))
        self.generated = Counter("specserve_generation_tokens_total", "generated tokens", tag_keys=s)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "time to first token",
                              boundaries=LATENCY_BOUNDS, tag_keys=s)
        self.tpot = Histogram("specserve_time_per_output_token_seconds", "time per output token after the first",
                              boundaries=TPOT_BOUNDS, tag_keys=s)
        self.e2e = Histogram("specserve_e2e_request_latency_seconds", "end-to-end request latency",
                             boundaries=LATENCY_BOUNDS, tag_keys=s)

    def record(self, strategy: str, outcome: str, result=None, e2e_s: float | None = None) -> None:
        """Count one finished request; ``result`` (a GenerationResult) for completed ones.  Never raises."""
        try:
            self._record(strategy_label(strategy), outcome if outcome in OUTCOMES else "error", result, e2e_s)
        except Exception as e:             # noqa: BLE001 - metrics never fail a request
            log.warning("metrics not recorded: %s", shown(e, 200))

    def _record(self, strategy: str, outcome: str, result, e2e_s: float | None) -> None:
        tags = {"strategy": strategy}
        self.requests.inc(1, {**tags, "outcome": outcome})
        if result is None:
            return
        st = result.stats
        if st.steps:
            self.drafts.inc(st.steps, tags)
        if st.drafted_tokens:
            self.draft_tokens.inc(st.drafted_tokens, tags)
        if st.accepted_tokens:
            self.accepted.inc(st.accepted_tokens, tags)
        for pos, n in enumerate(st.accepted_per_pos):
            if n:
                self.accepted_pos.inc(n, {**tags, "position": str(pos)})
        if st.generated_tokens:
            self.generated.inc(st.generated_tokens, tags)
        if st.ttft_s:
            self.ttft.observe(st.ttft_s, tags)
        if st.generated_tokens > 1:
            self.tpot.observe(max(0.0, st.wall_s - st.ttft_s) / (st.generated_tokens - 1), tags)
        if e2e_s is not None:
            self.e2e.observe(e2e_s, tags)


def make_metrics() -> Metrics | None:
    """Metrics when running inside Ray, else None (the coordinator then records nothing)."""
    try:
        import ray
        if not ray.is_initialized():
            return None
        return Metrics()
    except Exception:       # noqa: BLE001 - metrics are optional
        return None
