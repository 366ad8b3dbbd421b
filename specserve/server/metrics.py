"""Prometheus metrics of one serving instance, fed by the engine loop.

The engine loop hands a ``StepStats`` record after every step and a ``RequestStats`` record for every finished
request (see ``specserve/engine/stats.py``); HTTP handlers never touch these series. Every series lives in a
``CollectorRegistry`` owned by this object (no process-global registry), so several servers or tests can run
in one process.

Names and meanings mirror vLLM's ``vllm:*`` series so dashboards carry over by renaming the prefix:

- gauges ``specserve_num_requests_running``, ``specserve_num_requests_waiting`` and
  ``specserve_kv_cache_usage_perc`` (a fraction 0..1, like vLLM's despite the name);
- counters ``specserve_prompt_tokens_total`` and ``specserve_generation_tokens_total`` (tokens computed /
  emitted per step), ``specserve_num_preemptions_total`` and
  ``specserve_request_success_total{finished_reason}`` (every finished request, aborts included);
- per-request histograms of time to first token, mean time per output token, end-to-end latency, queue
  time, prompt length and generation length;
- speculative decoding, each series labelled by ``method`` (as vLLM's ``vllm:spec_decode_*``): counters
  ``specserve_spec_decode_num_drafts_total`` (drafts verified), ``..._num_draft_tokens_total`` (tokens
  drafted), ``..._num_accepted_tokens_total`` (draft tokens accepted) and
  ``..._num_accepted_tokens_per_pos_total{position}`` (drafts whose token at 0-based ``position`` was
  accepted); the histogram ``specserve_spec_decode_emitted_tokens_per_step`` of tokens one speculating request
  emitted in one step (1 .. num_spec_tokens + 1); and the per-request histogram
  ``specserve_request_spec_mean_acceptance_length`` (1 + accepted / drafts, requests with a draft only).

Rates and ratios are left to PromQL (``rate(specserve_generation_tokens_total[1m])``; acceptance rate =
``rate(..._num_accepted_tokens_total) / rate(..._num_draft_tokens_total)``). prometheus_client's
metrics are thread-safe, so the ``record_*`` methods may be called from the engine loop thread while
``render`` runs in the HTTP event loop.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from specserve.config import MAX_NUM_SPEC_TOKENS
from specserve.engine.stats import RequestStats, StepStats
from specserve.spec.params import SpecCounters

# Bucket boundaries as in vLLM (v1 metrics/loggers.py), in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
# Tokens one speculating request emits in a step: 1 (nothing accepted) .. num_spec_tokens + 1 (all + bonus).
EMITTED_TOKENS_BUCKETS = tuple(range(1, MAX_NUM_SPEC_TOKENS + 2))
ACCEPTANCE_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0,
                             10.0, 12.0, 14.0, 17.0)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """Token-count buckets 1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's scheme).

    >>> build_1_2_5_buckets(100)
    [1, 2, 5, 10, 20, 50, 100]
    """
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class ServingMetrics:
    """All Prometheus series of one served model, in a registry of its own."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 max_model_len: int = 131072, spec_methods: Iterable[str] = ()) -> None:
        """``spec_methods``: speculative methods the engine serves, exported as zeros from the first scrape."""
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        reg = self.registry
        labels = ["model_name"]
        token_buckets = build_1_2_5_buckets(max_model_len)

        self._num_running = Gauge(
            "specserve_num_requests_running", "Number of requests scheduled or holding KV cache.",
            labels, registry=reg).labels(model_name)
        self._num_waiting = Gauge(
            "specserve_num_requests_waiting", "Requests waiting for admission (preempted included).",
            labels, registry=reg).labels(model_name)
        self._kv_cache_usage = Gauge(
            "specserve_kv_cache_usage_perc", "KV-cache usage as a fraction of blocks in use, 0..1.",
            labels, registry=reg).labels(model_name)
        self._spec_draft_cap = Gauge(
            "specserve_spec_draft_cap", "Adaptive speculation: the cap on drafts per request chosen for the "
            "next step (-1: no cap, each request drafts its num_spec_tokens). Absent when the policy is off or no "
            "request is running.",
            labels, registry=reg)

        self._prompt_tokens = Counter(
            "specserve_prompt_tokens", "Number of prefill tokens computed.",
            labels, registry=reg).labels(model_name)
        self._generation_tokens = Counter(
            "specserve_generation_tokens", "Number of output tokens emitted.",
            labels, registry=reg).labels(model_name)
        self._preemptions = Counter(
            "specserve_num_preemptions", "Cumulative number of preemptions (recompute).",
            labels, registry=reg).labels(model_name)
        self._request_success = Counter(
            "specserve_request_success", "Number of finished requests, by finish reason.",
            labels + ["finished_reason"], registry=reg)
        for reason in ("stop", "length", "abort"):  # export zeros so rate() works from the first scrape
            self._request_success.labels(model_name, reason)

        self._ttft = Histogram(
            "specserve_time_to_first_token_seconds", "Seconds from arrival to the first output token.",
            labels, buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self._tpot = Histogram(
            "specserve_time_per_output_token_seconds",
            "Mean seconds between output tokens of a request (one sample per request).",
            labels, buckets=TPOT_BUCKETS, registry=reg).labels(model_name)
        self._e2e_latency = Histogram(
            "specserve_e2e_request_latency_seconds", "Seconds from arrival to finish.",
            labels, buckets=LATENCY_BUCKETS, registry=reg).labels(model_name)
        self._queue_time = Histogram(
            "specserve_request_queue_time_seconds", "Seconds from arrival to first scheduling.",
            labels, buckets=LATENCY_BUCKETS, registry=reg).labels(model_name)
        self._request_prompt_tokens = Histogram(
            "specserve_request_prompt_tokens", "Prompt length of finished requests, in tokens.",
            labels, buckets=token_buckets, registry=reg).labels(model_name)
        self._request_generation_tokens = Histogram(
            "specserve_request_generation_tokens", "Output length of finished requests, in tokens.",
            labels, buckets=token_buckets, registry=reg).labels(model_name)
        self._init_spec_series(labels + ["method"], spec_methods)

    def _init_spec_series(self, labels: list[str], methods: Iterable[str]) -> None:
        reg = self.registry
        self._spec_drafts = Counter(
            "specserve_spec_decode_num_drafts", "Number of speculative drafts verified.",
            labels, registry=reg)
        self._spec_draft_tokens = Counter(
            "specserve_spec_decode_num_draft_tokens", "Number of draft tokens proposed and verified.",
            labels, registry=reg)
        self._spec_accepted_tokens = Counter(
            "specserve_spec_decode_num_accepted_tokens", "Number of draft tokens accepted.",
            labels, registry=reg)
        self._spec_accepted_per_pos = Counter(
            "specserve_spec_decode_num_accepted_tokens_per_pos",
            "Number of drafts whose token at this 0-based position was accepted.",
            labels + ["position"], registry=reg)
        self._spec_emitted_per_step = Histogram(
            "specserve_spec_decode_emitted_tokens_per_step",
            "Tokens one speculating request emitted in one step (accepted drafts + 1).",
            labels, buckets=EMITTED_TOKENS_BUCKETS, registry=reg)
        self._spec_acceptance_length = Histogram(
            "specserve_request_spec_mean_acceptance_length",
            "Mean acceptance length (1 + accepted / drafts) of finished requests that drafted.",
            labels, buckets=ACCEPTANCE_LENGTH_BUCKETS, registry=reg)
        for method in methods:
            if method != "none":
                for series in (self._spec_drafts, self._spec_draft_tokens, self._spec_accepted_tokens,
                               self._spec_emitted_per_step, self._spec_acceptance_length):
                    series.labels(self.model_name, method)

    def record_step(self, stats: StepStats) -> None:
        """Update gauges and token counters after one engine step (engine loop thread)."""
        self._num_running.set(stats.num_running)
        self._num_waiting.set(stats.num_waiting)
        self._kv_cache_usage.set(stats.kv_cache_usage)
        if stats.spec_draft_cap is not None and stats.num_running:
            self._spec_draft_cap.labels(self.model_name).set(stats.spec_draft_cap)
        elif stats.spec_draft_cap is not None:  # idle: no cap is in force, so no value (not the last busy one)
            self._spec_draft_cap.remove(self.model_name)
        if stats.num_prompt_tokens:
            self._prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self._generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_preemptions:
            self._preemptions.inc(stats.num_preemptions)
        for method, counters in stats.spec.items():
            self._record_drafts(method, counters)
        for method, emitted in stats.spec_emitted_per_step.items():
            histogram = self._spec_emitted_per_step.labels(self.model_name, method)
            for num_tokens in emitted:
                histogram.observe(num_tokens)

    def _record_drafts(self, method: str, counters: SpecCounters) -> None:
        """Add one step's verified drafts of ``method``."""
        self._spec_drafts.labels(self.model_name, method).inc(counters.num_drafts)
        self._spec_draft_tokens.labels(self.model_name, method).inc(counters.num_draft_tokens)
        self._spec_accepted_tokens.labels(self.model_name, method).inc(counters.num_accepted_tokens)
        for position, num_accepted in enumerate(counters.accepted_per_pos):
            self._spec_accepted_per_pos.labels(self.model_name, method, str(position)).inc(num_accepted)

    def record_request(self, stats: RequestStats) -> None:
        """Count one finished request and observe its latencies and lengths (engine loop thread)."""
        self._request_success.labels(self.model_name, stats.finish_reason).inc()
        self._e2e_latency.observe(stats.e2e_latency)
        self._queue_time.observe(stats.queue_time)
        if stats.time_to_first_token is not None:
            self._ttft.observe(stats.time_to_first_token)
        if stats.time_per_output_token is not None:
            self._tpot.observe(stats.time_per_output_token)
        self._request_prompt_tokens.observe(stats.num_prompt_tokens)
        self._request_generation_tokens.observe(stats.num_generation_tokens)
        acceptance_length = stats.spec.mean_acceptance_length
        if stats.spec_method != "none" and acceptance_length is not None:
            self._spec_acceptance_length.labels(self.model_name, stats.spec_method).observe(acceptance_length)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every series: (body, content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
