"""Speculation counters read from Prometheus text, for specserve's and vLLM's series, and their deltas."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from specserve.bench.server_metrics import counter_delta, parse_spec_counters


def exposition(prefix: str, label: str, values: dict[str, dict[str, float]]) -> str:
    reg = CollectorRegistry()
    for name, by_label in values.items():
        counter = Counter(f"{prefix}{name}", name, [label], registry=reg)
        for value_label, v in by_label.items():
            counter.labels(value_label).inc(v)
    Counter(f"{prefix}unrelated", "noise", registry=reg).inc(99)
    return generate_latest(reg).decode()


def test_specserve_counters_sum_over_methods() -> None:
    text = exposition("specserve_spec_decode_", "method", {
        "num_drafts": {"ngram": 10, "draft": 5}, "num_draft_tokens": {"ngram": 40, "draft": 15},
        "num_accepted_tokens": {"ngram": 20, "draft": 3}})
    assert parse_spec_counters(text) == {"num_drafts": 15, "draft_tokens": 55, "accepted_tokens": 23}


def test_vllm_counters() -> None:
    text = exposition("vllm:spec_decode_", "model_name", {
        "num_drafts": {"m": 8}, "num_draft_tokens": {"m": 32}, "num_accepted_tokens": {"m": 16}})
    assert parse_spec_counters(text) == {"num_drafts": 8, "draft_tokens": 32, "accepted_tokens": 16}


def test_no_spec_counters() -> None:
    assert parse_spec_counters("# HELP x_total y\n# TYPE x_total counter\nx_total 3.0\n") == {}
    assert counter_delta({"counters": {}}, {"counters": {}}) is None


def test_delta_between_scrapes() -> None:
    before = {"counters": {"num_drafts": 10, "draft_tokens": 40, "accepted_tokens": 20}}
    after = {"counters": {"num_drafts": 30, "draft_tokens": 100, "accepted_tokens": 50}}
    d = counter_delta(before, after)
    assert (d["num_drafts"], d["draft_tokens"], d["accepted_tokens"]) == (20, 60, 30)
    assert d["acceptance_rate"] == pytest.approx(0.5) and d["mean_acceptance_length"] == pytest.approx(2.5)
    assert counter_delta({"error": "HTTP 404"}, after) is None
