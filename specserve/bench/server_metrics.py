"""Speculative-decoding counters read from a server's Prometheus ``/metrics``, for servers whose responses do not
carry ``usage.speculative``. Two snapshots around a load level give its deltas.

Recognised counters (vLLM's meanings; specserve labels its own by ``method``):
``specserve_spec_decode_num_drafts_total`` / ``_num_draft_tokens_total`` / ``_num_accepted_tokens_total`` and
vLLM's ``vllm:spec_decode_num_drafts`` / ``num_draft_tokens`` / ``num_accepted_tokens`` (``_total`` samples).
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specserve.bench.stats import acceptance_from_counts

# counter key -> metric family names as the parser reports them (the ``_total`` suffix stripped)
SPEC_COUNTERS = {
    "num_drafts": ("specserve_spec_decode_num_drafts", "vllm:spec_decode_num_drafts"),
    "draft_tokens": ("specserve_spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens"),
    "accepted_tokens": ("specserve_spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens"),
}


def parse_spec_counters(text: str) -> dict[str, float]:
    """Totals of the speculative-decoding counters in a Prometheus text exposition (summed over labels)."""
    family_key = {name: key for key, names in SPEC_COUNTERS.items() for name in names}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        key = family_key.get(family.name)
        if key is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") or sample.name == family.name:
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


async def scrape_spec_counters(client: httpx.AsyncClient, base_url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """``{"counters": {...}}`` from ``base_url/metrics``, or ``{"error": ...}``; never raises."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
        if resp.status_code != 200:
            return {"error": f"HTTP {resp.status_code}"}
        return {"counters": parse_spec_counters(resp.text)}
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """Acceptance over the level from two scrapes; None when either failed or the server has no such counters."""
    if "counters" not in before or "counters" not in after or not after["counters"]:
        return None
    b, a = before["counters"], after["counters"]
    delta = {key: a.get(key, 0.0) - b.get(key, 0.0) for key in SPEC_COUNTERS}
    return acceptance_from_counts(delta["num_drafts"], delta["draft_tokens"], delta["accepted_tokens"])
