"""Benchmark statistics on synthetic latencies: percentiles against numpy, the pooling rules of a level summary
(failed requests excluded, inter-token gaps pooled across requests, TPOT excluding the first token), and
acceptance summed from usage.speculative with the /metrics fallback."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.bench.client import RequestResult
from specserve.bench.stats import (
    acceptance_from_counts,
    acceptance_from_usage,
    choose_acceptance,
    latency_stats,
    summarize_level,
)


def make_result(index: int, ttft: float, gaps: list[float], tokens: int, *, ok: bool = True,
                spec: dict | None = None, stream_tokens: int | None = None) -> RequestResult:
    times = list(np.cumsum([ttft, *gaps]))
    r = RequestResult(index=index, dataset_row=index, ok=ok, ttft_s=ttft, chunk_times_s=times,
                      e2e_s=times[-1] + 0.001, usage_prompt_tokens=10, usage_completion_tokens=tokens,
                      stream_tokens=stream_tokens, speculative=spec)
    if not ok:
        r.error = "HTTP 500: boom"
    return r


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentiles_match_numpy(n: int) -> None:
    values = np.random.default_rng(n).lognormal(mean=-3, sigma=1.0, size=n)
    stats = latency_stats(list(values))
    for q in (50, 90, 99):
        assert stats[f"p{q}"] == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    assert stats["mean"] == pytest.approx(float(values.mean()))


def test_percentiles_of_a_known_small_set() -> None:
    stats = latency_stats([0.4, 0.1, 0.3, 0.2])  # sorted 0.1..0.4: linear interpolation between ranks
    assert stats["p50"] == pytest.approx(0.25)
    assert stats["p90"] == pytest.approx(0.37)
    assert stats["p99"] == pytest.approx(0.397)


def test_no_values_gives_none() -> None:
    assert latency_stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_level_summary_pools_only_successful_requests() -> None:
    rng = np.random.default_rng(0)
    good = [make_result(i, float(rng.uniform(0.05, 0.5)), list(rng.uniform(0.01, 0.1, size=5)), tokens=6)
            for i in range(20)]
    bad = make_result(99, 9.0, [9.0, 9.0], tokens=3, ok=False)
    s = summarize_level(good + [bad], duration_s=4.0)

    assert (s["num_requests"], s["num_ok"], s["num_errors"]) == (21, 20, 1)
    assert s["errors_by_kind"] == {"HTTP 500": 1}
    assert s["output_tokens"] == 120 and s["output_tok_s"] == pytest.approx(30.0)
    assert s["requests_per_s"] == pytest.approx(5.0)
    ttft = [r.ttft_s for r in good]
    itl = [g for r in good for g in np.diff(r.chunk_times_s)]
    tpot = [(r.e2e_s - r.ttft_s) / 5 for r in good]  # 6 tokens: 5 after the first
    e2e = [r.e2e_s for r in good]
    for key, values in (("ttft_s", ttft), ("itl_s", itl), ("tpot_s", tpot), ("e2e_s", e2e)):
        for q in (50, 90, 99):
            assert s[key][f"p{q}"] == pytest.approx(float(np.percentile(values, q))), (key, q)
    assert len(itl) == 100


def test_token_count_mismatch_is_flagged() -> None:
    same = make_result(0, 0.1, [0.1], tokens=2, stream_tokens=2)
    differs = make_result(1, 0.1, [0.1], tokens=3, stream_tokens=2)
    assert not same.token_count_mismatch and differs.token_count_mismatch
    tc = summarize_level([same, differs], 1.0)["token_count"]
    assert tc == {"checked": 2, "mismatches": 1, "stream_tokens": 4, "usage_tokens": 5, "missing_usage": 0}


def test_output_tokens_fall_back_to_stream_then_chunks() -> None:
    r = make_result(0, 0.1, [0.1, 0.1], tokens=7)
    assert r.output_tokens == 7
    r.usage_completion_tokens = None
    r.stream_tokens = 5
    assert r.output_tokens == 5
    r.stream_tokens = None
    assert r.output_tokens == 3  # three text chunks


def test_acceptance_sums_usage_counts() -> None:
    specs = [{"method": "ngram", "num_drafts": 4, "draft_tokens": 12, "accepted_tokens": 6,
              "accepted_per_position": [3, 2, 1]},
             {"method": "ngram", "num_drafts": 2, "draft_tokens": 6, "accepted_tokens": 0,
              "accepted_per_position": []}]
    results = [make_result(i, 0.1, [0.1], 2, spec=s) for i, s in enumerate(specs)]
    results.append(make_result(9, 0.1, [0.1], 2, spec={"num_drafts": 50, "draft_tokens": 50, "accepted_tokens": 50},
                               ok=False))  # a failed request does not count
    acc = acceptance_from_usage(results)
    assert acc is not None
    assert (acc["num_drafts"], acc["draft_tokens"], acc["accepted_tokens"]) == (6, 18, 6)
    assert acc["acceptance_rate"] == pytest.approx(6 / 18)
    assert acc["mean_acceptance_length"] == pytest.approx(1 + 6 / 6)
    assert acc["accepted_per_position"] == [3, 2, 1]
    assert acc["methods"] == ["ngram"]


def test_acceptance_prefers_usage_then_metrics() -> None:
    metrics = acceptance_from_counts(10, 30, 15)
    assert metrics["mean_acceptance_length"] == pytest.approx(2.5)
    assert choose_acceptance(None, metrics)["source"] == "metrics"
    usage = {**acceptance_from_counts(4, 8, 2), "methods": ["ngram"]}
    assert choose_acceptance(usage, metrics)["source"] == "usage.speculative"
    assert choose_acceptance(None, acceptance_from_counts(0, 0, 0)) is None
    assert acceptance_from_usage([make_result(0, 0.1, [0.1], 2)]) is None


def test_an_unstreamed_end_token_is_not_a_mismatch() -> None:
    stopped = make_result(0, 0.1, [0.1], tokens=5, stream_tokens=4)
    stopped.finish_reason = "stop"  # usage counts the EOS that ended it; the stream never shows it
    cut = make_result(1, 0.1, [0.1], tokens=5, stream_tokens=4)
    cut.finish_reason = "length"
    assert not stopped.token_count_mismatch and cut.token_count_mismatch
    far = make_result(2, 0.1, [0.1], tokens=5, stream_tokens=3)
    far.finish_reason = "stop"
    assert far.token_count_mismatch
