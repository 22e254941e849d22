"""Serving metrics through Ray Serve's metrics API, exported by Ray's Prometheus endpoint on every node.

Names are vLLM's with ``vllm:`` written ``vllm_`` -- the names vLLM's own Ray metric wrappers register
(``vllm/v1/metrics/ray_wrappers.py``), so that Ray exports exactly the series Ray Serve LLM's Grafana dashboard
queries.  The set follows vLLM 0.33.0's ``vllm/v1/metrics/loggers.py`` (tests/serving/test_metrics_names.py
holds it there): ``time_per_output_token_seconds``, deprecated in vLLM 0.11 and removed after 0.12, is dropped
for ``inter_token_latency_seconds`` (one observation per engine step that produced tokens, as vLLM's
per-iteration ITL) and ``request_time_per_output_token_seconds`` (per request); the request phases
(queue, prefill, decode, inference) are timed as vLLM's ``RequestStateStats`` (``vllm/v1/metrics/stats.py``):
queued at admission, scheduled when the request joins the running batch, first and last token when the
engine emits them.  ``kv_cache_usage_perc`` is the fraction of the unit's KV positions the running requests
reserve (``engine.kv_budget_tokens``, configured or derived from device memory), what admission is decided
on.  Ray prefixes every name with ``ray_`` and counters with a ``_total`` suffix: ``vllm_spec_decode_num_drafts`` is scraped as
``ray_vllm_spec_decode_num_drafts_total``.  (A ``:`` in a Ray metric name is deprecated and the series is
dropped by Ray 2.60's OpenTelemetry exporter.)  EXPORTED lists every scraped name, SPECULATION those a unit in the
``speculator`` topology adds (the speculation cache: hits by branch kind, late answers, wasted draft tokens, fan-out).

Labels: ``model_name`` (the served model id, as vLLM labels it) and ``strategy`` on every per-request series,
plus ``position`` / ``finished_reason`` / ``outcome`` where named; inside a Serve replica Ray Serve adds
``deployment``, ``replica`` and ``application``, and Ray adds ``WorkerId``, ``NodeAddress``, ``SessionName``.
Label values are only ever validated ones (a registered strategy, else ``invalid``; a known outcome), so a
client cannot create series; recording never raises into a request.

Counting: the coordinator counts every request it admitted when it ends (:meth:`Metrics.record` with the
sequence's error, which it marks); the gRPC and HTTP fronts count what they refuse before or at admission
(:func:`cluster.serving.ops.error_table.refusal_outcome` says which outcome, and None for an error the coordinator
already counted).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from cluster.errors import shown
from cluster.serving.ops.error_table import COUNTED
from cluster.strategies import REGISTRY

LATENCY_BOUNDS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
# vLLM's request-latency buckets (vllm/v1/metrics/buckets.py) for the phase histograms; ours below 0.3 s
# too, since a tiny model's phases take milliseconds
PHASE_BOUNDS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TPOT_BOUNDS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
TOKEN_BOUNDS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
RATE_BOUNDS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99]   # a share in [0, 1]
OUTCOMES = ("ok", "cancelled", "invalid", "not_found", "overloaded", "unauthenticated", "unavailable",
            "deadline", "error")
INVALID_LABEL = "invalid"

# the series as Prometheus scrapes them (histograms also as _bucket / _sum / _count)
EXPORTED = {
    "ray_vllm_spec_decode_num_drafts_total": "counter", "ray_vllm_spec_decode_num_draft_tokens_total": "counter",
    "ray_vllm_spec_decode_num_accepted_tokens_total": "counter",
    "ray_vllm_spec_decode_num_accepted_tokens_per_pos_total": "counter",
    "ray_vllm_prompt_tokens_total": "counter", "ray_vllm_generation_tokens_total": "counter",
    "ray_vllm_prefix_cache_queries_total": "counter", "ray_vllm_prefix_cache_hits_total": "counter",
    "ray_vllm_request_success_total": "counter",
    "ray_vllm_num_requests_running": "gauge", "ray_vllm_num_requests_waiting": "gauge",
    "ray_vllm_kv_cache_usage_perc": "gauge",
    "ray_vllm_time_to_first_token_seconds": "histogram", "ray_vllm_inter_token_latency_seconds": "histogram",
    "ray_vllm_request_time_per_output_token_seconds": "histogram",
    "ray_vllm_request_queue_time_seconds": "histogram", "ray_vllm_request_prefill_time_seconds": "histogram",
    "ray_vllm_request_decode_time_seconds": "histogram", "ray_vllm_request_inference_time_seconds": "histogram",
    "ray_vllm_e2e_request_latency_seconds": "histogram", "ray_vllm_request_prompt_tokens": "histogram",
    "ray_vllm_request_generation_tokens": "histogram",
    "ray_specserve_requests_total": "counter", "ray_specserve_cascade_deferrals_total": "counter",
    "ray_specserve_cascade_deferral_checks_total": "counter", "ray_specserve_model_up": "gauge",
    "ray_specserve_request_acceptance_rate": "histogram",
}
# the speculation cache's series, scraped where a unit runs the ``speculator`` topology (cluster/core/draft/cache.py)
SPECULATION = {
    "ray_specserve_speculation_steps_total": "counter", "ray_specserve_speculation_hits_total": "counter",
    "ray_specserve_speculation_late_total": "counter", "ray_specserve_speculation_wasted_draft_tokens_total": "counter",
    "ray_specserve_speculation_branches_total": "counter", "ray_specserve_speculation_fills_total": "counter",
    "ray_specserve_speculation_raced_total": "counter", "ray_specserve_speculation_ahead_total": "counter",
    "ray_specserve_speculation_short_total": "counter",
}

log = logging.getLogger("specserve.metrics")

# (CacheCounters field, series name, help, extra tags): hits by branch kind (bonus: the whole block accepted and
# the bonus guessed; reject: a rejection at some position with its correction guessed); fan-out = branches / fills
SPECULATION_COUNTERS = (
    ("steps", "steps", "blocks asked of the near-far draft side (speculative steps, per request)", ()),
    ("hits", "hits", "blocks served from the speculation cache, by branch kind", ("kind",)),
    ("late", "late", "steps whose speculator answer had not arrived (drafted near)", ()),
    ("wasted", "wasted_draft_tokens", "tokens the speculator drafted that no step used", ()),
    ("rows", "branches", "branches the speculator drafted (answered in time)", ()),
    ("fills", "fills", "speculator answers that arrived in time", ()),
    ("raced", "raced", "hits (of hits) from a late answer taken while the near drafter drafted", ()),
    ("ahead", "ahead", "requests of answers in time that the speculator drafted ahead of their fill", ()),
    ("short", "short", "right bets not taken: shorter than asked, in a step that drafted near anyway", ()))


@dataclass
class Timeline:
    """One request's timestamps (``time.perf_counter`` seconds), kept as vLLM's ``RequestStateStats``: queued
    at admission, scheduled when it joined the running batch, first / last token when a chunk carrying
    tokens was emitted; ``itl``: the gap before each later chunk (one per engine step that produced tokens)."""
    queued: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    itl: list[float] = field(default_factory=list)

    def tokens(self, now: float | None = None) -> None:
        """A chunk with tokens was emitted at ``now``."""
        now = time.perf_counter() if now is None else now
        if self.first_token is None:
            self.first_token = now
        else:
            self.itl.append(now - self.last_token)
        self.last_token = now

    def phases(self) -> dict[str, float]:
        """vLLM's queue / prefill / decode / inference times (vllm/v1/metrics/stats.py); only the phases
        this request reached."""
        if self.scheduled is None:
            return {}
        out = {"queue": max(0.0, self.scheduled - self.queued)}
        if self.first_token is not None:
            out["prefill"] = max(0.0, self.first_token - self.scheduled)
            out["decode"] = self.last_token - self.first_token
            out["inference"] = max(0.0, self.last_token - self.scheduled)
        return out


def strategy_label(strategy) -> str:
    """The metric label of a strategy name: itself if registered, else ``invalid``."""
    return strategy if isinstance(strategy, str) and strategy in REGISTRY else INVALID_LABEL


def finished_reason(reason: str | None) -> str:
    """vLLM's ``finished_reason`` label: ``stop`` (EOS or a stop string), ``length``, else ``abort``."""
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason or "", "abort")


class Metrics:
    def __init__(self, model_name: str = "specserve"):
        # Ray Serve's metrics add the deployment, replica and application tags inside a replica
        from ray.serve.metrics import Counter, Gauge, Histogram
        self.model_name = model_name
        s = ("model_name", "strategy")

        def counter(name, doc, *extra):
            return Counter(name, doc, tag_keys=s + extra)

        def histogram(name, doc, bounds):
            return Histogram(name, doc, boundaries=bounds, tag_keys=s)
        self.drafts = counter("vllm_spec_decode_num_drafts", "verification steps (target passes over drafts)")
        self.draft_tokens = counter("vllm_spec_decode_num_draft_tokens", "drafted tokens")
        self.accepted = counter("vllm_spec_decode_num_accepted_tokens", "accepted draft tokens")
        self.accepted_pos = counter("vllm_spec_decode_num_accepted_tokens_per_pos",
                                    "accepted draft tokens by draft position (0-based)", "position")
        self.prompt_tokens = counter("vllm_prompt_tokens", "prompt tokens of completed requests")
        self.generated = counter("vllm_generation_tokens", "generated tokens of completed requests")
        self.cache_queries = counter("vllm_prefix_cache_queries", "prompt tokens looked up in the target's "
                                     "prefix cache")
        self.cache_hits = counter("vllm_prefix_cache_hits", "prompt tokens found in the target's prefix cache")
        self.success = counter("vllm_request_success", "finished requests by vLLM finish reason", "finished_reason")
        self.requests = counter("specserve_requests", "requests by outcome, refused ones included", "outcome")
        self.deferrals = counter("specserve_cascade_deferrals", "cascade positions deferred to the target "
                                 "(expected value for token-level rules)")
        self.deferral_checks = counter("specserve_cascade_deferral_checks", "cascade positions a rule decided")
        self.running = Gauge("vllm_num_requests_running", "requests in the running batch", tag_keys=("model_name",))
        self.waiting = Gauge("vllm_num_requests_waiting", "requests waiting for the batch", tag_keys=("model_name",))
        self.ttft = histogram("vllm_time_to_first_token_seconds", "time to first token", LATENCY_BOUNDS)
        self.kv_usage = Gauge("vllm_kv_cache_usage_perc", "KV positions the running requests reserve, of the "
                              "unit's budget; 1 means 100 percent", tag_keys=("model_name",))
        self.itl = histogram("vllm_inter_token_latency_seconds", "time between engine steps that emitted tokens "
                             "of a request", TPOT_BOUNDS)
        self.req_tpot = histogram("vllm_request_time_per_output_token_seconds", "time per output token after "
                                  "the first, per request", TPOT_BOUNDS)
        self.phase = {name: histogram(f"vllm_request_{name}_time_seconds", doc, PHASE_BOUNDS) for name, doc in (
            ("queue", "time waiting for the running batch"), ("prefill", "time from joining the batch to the "
             "first token"), ("decode", "time from the first token to the last"),
            ("inference", "time from joining the batch to the last token"))}
        self.e2e = histogram("vllm_e2e_request_latency_seconds", "end-to-end request latency", LATENCY_BOUNDS)
        self.req_prompt = histogram("vllm_request_prompt_tokens", "prompt tokens per request", TOKEN_BOUNDS)
        self.req_generated = histogram("vllm_request_generation_tokens", "generated tokens per request",
                                       TOKEN_BOUNDS)
        # an output-quality signal per request: garbled output drives a request's acceptance toward 0, a loop
        # (the drafters copy it) toward 1; only requests that drafted are observed
        self.acceptance = histogram("specserve_request_acceptance_rate", "accepted of drafted tokens, per request "
                                    "that drafted (vLLM's draft acceptance rate, per request)", RATE_BOUNDS)
        self.model_up = Gauge("specserve_model_up", "1 while a model of the unit answers, 0 while it is marked "
                              "down (its requests go on without it; a down target fails them)",
                              tag_keys=("model_name", "model"))
        unit = ("model_name",)
        self.speculation = {key: Counter(f"specserve_speculation_{name}", doc, tag_keys=unit + extra)
                            for key, name, doc, extra in SPECULATION_COUNTERS}
        self._load: tuple[int, int, float] | None = None

    def record_speculation(self, delta: dict) -> None:
        """The speculation cache's counters since the last call (``CacheCounters.as_dict()`` differences, the
        coordinator's watchdog round).  Never raises."""
        try:
            tags = {"model_name": self.model_name}
            for key, _, _, extra in SPECULATION_COUNTERS:
                for kind in (("bonus", "reject", "known") if extra else (None,)):   # cache.KINDS (room: no core)
                    n = delta.get(f"{key}_{kind}" if kind else key, 0)
                    if n > 0:
                        self.speculation[key].inc(n, {**tags, "kind": kind} if kind else tags)
        except Exception as e:             # noqa: BLE001
            log.warning("speculation not recorded: %s", shown(e, 200))

    def record(self, strategy: str, outcome: str, result=None, e2e_s: float | None = None,
               error: BaseException | None = None, timeline: Timeline | None = None) -> None:
        """Count one request; ``result`` (a GenerationResult) for completed ones; ``error``: the error an
        admitted request ended with, marked as counted for the fronts; ``timeline``: its phases and
        inter-token gaps.  Never raises."""
        try:
            if error is not None:
                setattr(error, COUNTED, True)
            self._record(strategy_label(strategy), outcome if outcome in OUTCOMES else "error", result, e2e_s,
                         timeline)
        except Exception as e:             # noqa: BLE001 - metrics never fail a request
            log.warning("metrics not recorded: %s", shown(e, 200))

    def set_load(self, running: int, waiting: int, kv_usage: float = 0.0, *, refresh: bool = False) -> None:
        """The unit's running and waiting request counts and KV usage (after each engine step; ``refresh``:
        set again even if unchanged).  Never raises."""
        if self._load == (running, waiting, kv_usage) and not refresh:
            return
        try:
            tags = {"model_name": self.model_name}
            self.running.set(running, tags)
            self.waiting.set(waiting, tags)
            self.kv_usage.set(kv_usage, tags)
            self._load = (running, waiting, kv_usage)
        except Exception as e:             # noqa: BLE001
            log.warning("load not recorded: %s", shown(e, 200))

    def set_models_up(self, up: dict[str, bool]) -> None:
        """Each model of the unit: answering (True) or marked down, and the last load again (after each
        watchdog round).  Set every round, changed or not: Ray's metrics agent evicts a gauge series that was
        not set within two export intervals (``ray/_private/telemetry/open_telemetry_metric_recorder.py``,
        gauge TTL), so a gauge set only on change vanished from the scrape of an idle replica.  Never raises."""
        try:
            for model, ok in up.items():
                self.model_up.set(1.0 if ok else 0.0, {"model_name": self.model_name, "model": model})
        except Exception as e:             # noqa: BLE001
            log.warning("model health not recorded: %s", shown(e, 200))
        self.set_load(*(self._load or (0, 0, 0.0)), refresh=True)

    def _record(self, strategy: str, outcome: str, result, e2e_s: float | None, timeline: Timeline | None) -> None:
        tags = {"model_name": self.model_name, "strategy": strategy}
        self.requests.inc(1, {**tags, "outcome": outcome})
        if outcome == "cancelled":
            self.success.inc(1, {**tags, "finished_reason": "abort"})
        if result is None:
            return
        st = result.stats
        self.success.inc(1, {**tags, "finished_reason": finished_reason(result.finish_reason)})
        for counter, n in ((self.drafts, st.steps), (self.draft_tokens, st.drafted_tokens),
                           (self.accepted, st.accepted_tokens), (self.prompt_tokens, st.prompt_tokens),
                           (self.generated, st.generated_tokens), (self.cache_queries, st.prompt_tokens),
                           (self.cache_hits, st.cached_tokens), (self.deferrals, st.deferrals),
                           (self.deferral_checks, st.deferral_checks)):
            if n:
                counter.inc(n, tags)
        for pos, n in enumerate(st.accepted_per_pos):
            if n:
                self.accepted_pos.inc(n, {**tags, "position": str(pos)})
        if st.drafted_tokens:
            self.acceptance.observe(st.accepted_tokens / st.drafted_tokens, tags)
        self.req_prompt.observe(st.prompt_tokens, tags)
        self.req_generated.observe(st.generated_tokens, tags)
        if st.ttft_s:
            self.ttft.observe(st.ttft_s, tags)
        if st.generated_tokens > 1:
            self.req_tpot.observe(max(0.0, st.wall_s - st.ttft_s) / (st.generated_tokens - 1), tags)
        if timeline is not None:
            for gap in timeline.itl:
                self.itl.observe(gap, tags)
            for name, seconds in timeline.phases().items():
                self.phase[name].observe(seconds, tags)
        if e2e_s is not None:
            self.e2e.observe(e2e_s, tags)


def make_metrics(model_name: str = "specserve") -> Metrics | None:
    """Metrics when running inside Ray, else None (the coordinator then records nothing)."""
    try:
        import ray
        if not ray.is_initialized():
            return None
        return Metrics(model_name)
    except Exception:       # noqa: BLE001 - metrics are optional
        return None
