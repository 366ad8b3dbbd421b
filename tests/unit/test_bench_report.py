"""The report writer on a synthetic report: JSON round trip, Markdown tables, PNG plots, cost per 1M tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.bench.client import RequestResult
from specserve.bench.cost import level_cost, load_api_prices, usd_per_million_tokens
from specserve.bench.report import new_report, render_markdown, run_acceptance, write_report
from specserve.bench.stats import acceptance_from_counts, summarize_level

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_run(label: str, method: str | None, k: int | None, tok_scale: float, accepted: int) -> dict:
    levels = []
    for c in (1, 4):
        results = [RequestResult(index=i, dataset_row=i, ok=True, ttft_s=0.1 * c, chunk_times_s=[0.1 * c, 0.2 * c],
                                 e2e_s=0.25 * c, usage_completion_tokens=10, stream_tokens=10) for i in range(c)]
        results.append(RequestResult(index=c, dataset_row=0, ok=False, error="timeout: no complete response"))
        summary = summarize_level(results, duration_s=1.0 / tok_scale)
        acc = ({"source": "usage.speculative", **acceptance_from_counts(10, 30, accepted)}
               if method not in (None, "none") else None)
        levels.append({"concurrency": c, "request_rate": None, "num_prompts": c + 1, "summary": summary,
                       "acceptance": acc, "cost": level_cost(0.5, summary["output_tok_s"], load_api_prices()),
                       "requests": [r.to_json() for r in results]})
    return {"label": label, "command": "specserve bench ...", "base_url": "http://x", "model": "m",
            "endpoint": "chat", "dataset": "mt_bench", "max_tokens": 10, "temperature": 0.0,
            "server": {"spec_method": method, "num_spec_tokens": k},
            "cost_basis": {"kind": "gpu", "usd_per_hour": 0.5}, "levels": levels}


def test_cost_per_million_tokens() -> None:
    assert usd_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)  # 3.6 M tokens per hour for $3.6
    assert usd_per_million_tokens(1.0, 0.0) is None
    prices = {"prices": [{"model": "API", "output_usd_per_mtok": 10.0}]}
    cost = level_cost(3.6, 1000.0, prices)
    assert cost["usd_per_million_output_tokens"] == pytest.approx(1.0)
    assert cost["api_price_over_ours"]["API"] == pytest.approx(10.0)
    assert level_cost(None, 1000.0, prices) is None


def test_api_price_table_is_dated_and_sourced() -> None:
    prices = load_api_prices()
    assert prices["read_on"] and prices["prices"]
    providers = {p["provider"] for p in prices["prices"]}
    assert {"Anthropic", "OpenAI"} <= providers
    for p in prices["prices"]:
        assert p["source"].startswith("https://") and p["status"] in ("confirmed", "unconfirmed")
        assert p["output_usd_per_mtok"] > 0


def test_report_files(tmp_path: Path) -> None:
    report = new_report()
    report["runs"] = [synthetic_run("none", "none", None, 1.0, 0),
                      synthetic_run("ngram k=2", "ngram", 2, 1.5, 12), synthetic_run("ngram k=4", "ngram", 4, 1.2, 18)]
    paths = write_report(report, tmp_path)
    names = {p.name for p in paths}
    assert {"report.json", "report.md", "throughput_vs_concurrency.png", "p99_tpot_vs_concurrency.png",
            "acceptance_length.png"} <= names
    for p in paths:
        assert p.stat().st_size > 0
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG_MAGIC
    loaded = json.loads((tmp_path / "report.json").read_text())
    assert loaded["runs"][1]["levels"][0]["requests"][0]["usage_completion_tokens"] == 10
    md = (tmp_path / "report.md").read_text()
    assert "## Comparison" in md and "| ngram k=4 |" in md and "timeout x1" in md
    assert "## Acceptance per dataset" in md and "Claude Sonnet" in md and "GPT-5" in md


def test_no_acceptance_plot_without_speculation(tmp_path: Path) -> None:
    report = new_report()
    report["runs"] = [synthetic_run("plain", None, None, 1.0, 0)]
    names = {p.name for p in write_report(report, tmp_path)}
    assert "acceptance_length.png" not in names and "throughput_vs_concurrency.png" in names
    assert "No run reported speculative decoding" in render_markdown(report)


def test_run_acceptance_sums_levels() -> None:
    acc = run_acceptance(synthetic_run("x", "ngram", 2, 1.0, 12))
    assert (acc["num_drafts"], acc["draft_tokens"], acc["accepted_tokens"]) == (20, 60, 24)
    assert acc["mean_acceptance_length"] == pytest.approx(1 + 24 / 20)
