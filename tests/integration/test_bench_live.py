"""`specserve bench` against a live specserve (SmolLM2-135M-Instruct on CPU, n-gram speculation, loopback):
streamed token counts equal the server's usage, acceptance from usage.speculative equals the /metrics deltas,
the report and plots are written, a dead server is reported per request, Ctrl-C writes a partial report, and
(slow) a sweep starts, measures and stops its own servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from specserve.bench.cli import EXIT_FAILED_REQUESTS, EXIT_INTERRUPTED, EXIT_OK
from specserve.cli import main
from specserve.config import SpecConfig

from .conftest import LiveServer, live_server, make_real_async_engine

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
K = 3
PROMPTS = [  # copying prompts make n-gram drafts accepted; open questions make them rejected
    "Copy this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
    "Name three colours.",
    "Repeat after me: one two three four five six seven eight.",
    "What is the capital of France? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def ngram_server(smollm2_gguf_path) -> Iterator[LiveServer]:
    yield from live_server(make_real_async_engine(SpecConfig(method="ngram", num_spec_tokens=K)))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench-data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def bench(out: Path, base_url: str, prompts_file: Path, *flags: str) -> int:
    return main(["bench", "--base-url", base_url, "--dataset", f"jsonl:{prompts_file}", "--out", str(out),
                 "--no-progress", *flags])


@pytest.fixture(scope="module")
def live_report(ngram_server: LiveServer, prompts_file: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[int, Path]:
    out = tmp_path_factory.mktemp("bench-live")
    rc = bench(out, ngram_server.base_url, prompts_file, "--concurrency", "1,3", "--num-prompts", "4,4",
               "--max-tokens", "24", "--machine-hour-usd", "0.1", "--server-spec-method", "ngram",
               "--server-num-spec-tokens", str(K), "--save-text")
    return rc, out


def test_stream_token_counts_match_usage(live_report: tuple[int, Path], ngram_server: LiveServer) -> None:
    rc, out = live_report
    assert rc == EXIT_OK
    run = json.loads((out / "report.json").read_text())["runs"][0]
    assert run["model"] == ngram_server.model  # read from /v1/models
    assert run["tokenizer"].startswith("default model")
    tok = ngram_server.engine.tokenizer
    for lv in run["levels"]:
        assert lv["summary"]["num_ok"] == 4 and lv["summary"]["token_count"]["mismatches"] == 0
        for r in lv["requests"]:
            assert r["ok"] and 1 <= r["usage_completion_tokens"] <= 24
            # usage counts the EOS that ended a "stop" response; the stream never carries it
            streamed = r["usage_completion_tokens"] - (r["finish_reason"] == "stop")
            assert r["stream_tokens"] == streamed and not r["token_count_mismatch"]
            assert len(tok.encode(r["output_text"])) == streamed
            assert r["num_chunks"] <= r["usage_completion_tokens"]  # a chunk carries 1..k+1 tokens
            assert 0 < r["ttft_s"] <= r["chunk_times_s"][-1] <= r["e2e_s"]
        total = sum(r["usage_completion_tokens"] for r in lv["requests"])
        assert lv["summary"]["output_tokens"] == total
        assert lv["summary"]["output_tok_s"] == pytest.approx(total / lv["summary"]["duration_s"])


def test_acceptance_from_usage_equals_metrics_deltas(live_report: tuple[int, Path]) -> None:
    run = json.loads((live_report[1] / "report.json").read_text())["runs"][0]
    copying = 0
    for lv in run["levels"]:
        usage, metrics = lv["acceptance_from_usage"], lv["acceptance_from_metrics"]
        assert usage is not None and metrics is not None and lv["acceptance"]["source"] == "usage.speculative"
        for key in ("num_drafts", "draft_tokens", "accepted_tokens"):
            assert usage[key] == metrics[key]
        assert 1.0 <= usage["mean_acceptance_length"] <= K + 1
        copying += usage["accepted_tokens"]
    assert copying > 0  # the copying prompts get drafts accepted


def test_report_and_plots_written(live_report: tuple[int, Path]) -> None:
    out = live_report[1]
    report = json.loads((out / "report.json").read_text())
    assert set(report["plots"]) == {"throughput_vs_concurrency.png", "p99_tpot_vs_concurrency.png",
                                    "acceptance_length.png"}
    for name in report["plots"]:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000
    md = (out / "report.md").read_text()
    assert "| c=1 | 4 / 4 |" in md and "| c=3 | 4 / 4 |" in md and "## Acceptance per dataset" in md
    assert report["runs"][0]["levels"][0]["cost"]["usd_per_million_output_tokens"] > 0


def test_dead_server_is_reported_per_request(prompts_file: Path, tmp_path: Path) -> None:
    port = _closed_port()
    rc = bench(tmp_path, f"http://127.0.0.1:{port}", prompts_file, "--model", "m", "--concurrency", "2",
               "--num-prompts", "3", "--request-timeout", "5")
    assert rc == EXIT_FAILED_REQUESTS
    report = json.loads((tmp_path / "report.json").read_text())
    (lv,) = report["runs"][0]["levels"]
    assert lv["summary"]["num_requests"] == 3 and lv["summary"]["num_ok"] == 0
    assert lv["summary"]["errors_by_kind"] == {"connection failed": 3}
    assert all("Connect" in r["error"] or "refused" in r["error"] for r in lv["requests"])
    assert lv["metrics_scrape_errors"]
    assert "**3 request(s) failed** (connection failed x3)" in (tmp_path / "report.md").read_text()


def test_ctrl_c_writes_a_partial_report(ngram_server: LiveServer, prompts_file: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "specserve.cli", "bench", "--base-url", ngram_server.base_url,
           "--dataset", f"jsonl:{prompts_file}", "--out", str(tmp_path), "--concurrency", "2,4",
           "--num-prompts", "200", "--max-tokens", "16", "--warmup-requests", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        _wait_for_first_request(ngram_server, timeout_s=60)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    run = report["runs"][0]
    assert run["interrupted"] and len(run["levels"]) == 1  # the second level never started
    assert run["levels"][0]["summary"]["num_requests"] < 200
    assert "Interrupted" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_sweep_starts_and_stops_its_servers(prompts_file: Path, tmp_path: Path) -> None:
    rc = main(["bench", "--sweep", "--spec-methods", "ngram", "--spec-tokens", "2", "--concurrency", "1,2",
               "--num-prompts", "2", "--max-tokens", "8", "--dataset", f"jsonl:{prompts_file}", "--out",
               str(tmp_path), "--no-progress",
               "--serve-args", "--max-num-seqs 4 --max-model-len 512 --kv-cache-memory-gib 0.1 --log-level warning"])
    assert rc == EXIT_OK
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["label"] for r in report["runs"]] == ["none", "ngram k=2"]
    assert report["runs"][1]["server"]["num_spec_tokens"] == 2
    rows = report["sweep"]["inflection"]["ngram"]["per_concurrency"]
    assert [r["concurrency"] for r in rows] == [1, 2] and all(r["best_k"] == 2 for r in rows)
    for config in report["sweep"]["configs"]:
        assert "error" not in config and Path(config["log"]).exists()
        port = int(config["serve_command"].split("--port ")[1].split()[0])
        with pytest.raises(httpx.ConnectError):  # stopped
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False)
    assert "## Sweep: where speculation stops paying" in (tmp_path / "report.md").read_text()


def _closed_port() -> int:
    import socket
    with socket.socket() as s:  # a port free right now: nothing listens there, so connections are refused
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_first_request(server: LiveServer, timeout_s: float) -> None:
    """Until the server has finished at least one request of the benchmark (its success counter moved)."""
    from .conftest import metric_value

    start = metric_value(server, "specserve_request_success_total")
    deadline = time.monotonic() + timeout_s
    while metric_value(server, "specserve_request_success_total") <= start:
        if time.monotonic() > deadline:
            raise TimeoutError("the benchmark never completed a request")
        time.sleep(0.1)
