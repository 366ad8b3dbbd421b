"""Summaries of one load level: throughput, latency percentiles, token-count agreement, speculation.

Percentiles use linear interpolation between order statistics (numpy's default). Latencies pool over the
successful requests only: TTFT, TPOT and end-to-end latency one value per request, inter-token latency one
value per gap between text-carrying chunks, across all requests. Throughput divides the output tokens of
successful requests by the level's wall time (first send to last response).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from specserve.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def latency_stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 of ``values`` in seconds (None each when there are none)."""
    if len(values) == 0:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64)
    pct = np.percentile(arr, PERCENTILES)
    return {"mean": float(arr.mean()), **{f"p{q}": float(v) for q, v in zip(PERCENTILES, pct)}}


def error_kind(error: str) -> str:
    """A short class of an error message, for counting ("connection failed", "HTTP 400", "timeout", ...)."""
    head = error.split(":", 1)[0]
    return head if len(head) <= 40 else head[:40]


def summarize_level(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """The numbers one level reports (see the module docstring)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    stream_counted = [r for r in ok if r.stream_tokens is not None and r.usage_completion_tokens is not None]
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "errors_by_kind": dict(Counter(error_kind(r.error) for r in results if r.error)),
        "duration_s": duration_s,
        "input_tokens": sum(r.usage_prompt_tokens or 0 for r in ok),
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration,
        "requests_per_s": len(ok) / duration,
        "mean_output_tokens": out_tokens / len(ok) if ok else None,
        "ttft_s": latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": latency_stats([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_s": latency_stats([gap for r in ok for gap in r.itl_s]),
        "e2e_s": latency_stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        "token_count": {
            "checked": len(stream_counted),
            "mismatches": sum(r.token_count_mismatch for r in ok),
            "stream_tokens": sum(r.stream_tokens or 0 for r in stream_counted),
            "usage_tokens": sum(r.usage_completion_tokens or 0 for r in stream_counted),
            "missing_usage": sum(r.usage_completion_tokens is None for r in ok),
        },
    }


def acceptance_from_counts(num_drafts: float, draft_tokens: float, accepted_tokens: float) -> dict[str, Any]:
    """Acceptance rate (accepted / drafted) and mean acceptance length (1 + accepted / drafts)."""
    return {"num_drafts": num_drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted_tokens,
            "acceptance_rate": accepted_tokens / draft_tokens if draft_tokens else None,
            "mean_acceptance_length": 1 + accepted_tokens / num_drafts if num_drafts else None}


def acceptance_from_usage(results: Iterable[RequestResult]) -> dict[str, Any] | None:
    """Acceptance summed over the ``usage.speculative`` of successful requests; None when none carried one."""
    specs = [r.speculative for r in results if r.ok and r.speculative]
    if not specs:
        return None
    totals = acceptance_from_counts(sum(s.get("num_drafts", 0) for s in specs),
                                    sum(s.get("draft_tokens", 0) for s in specs),
                                    sum(s.get("accepted_tokens", 0) for s in specs))
    per_position: list[int] = []
    for s in specs:
        for i, n in enumerate(s.get("accepted_per_position") or []):
            if i == len(per_position):
                per_position.append(0)
            per_position[i] += n
    methods = sorted({str(s.get("method")) for s in specs})
    return {**totals, "methods": methods, "num_requests": len(specs), "accepted_per_position": per_position}


def choose_acceptance(from_usage: dict[str, Any] | None, from_metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    """The acceptance a level reports: from usage.speculative when present, else from /metrics deltas."""
    if from_usage is not None and from_usage["num_drafts"]:
        return {"source": "usage.speculative", **from_usage}
    if from_metrics is not None and from_metrics.get("num_drafts"):
        return {"source": "metrics", **from_metrics}
    return None
