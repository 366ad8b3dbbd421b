"""`specserve bench` argument handling: lists, per-level prompt counts, bad values exit 2 before any request."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from specserve.bench.cli import EXIT_USAGE, _plans
from specserve.cli import build_parser, main


def bench_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "--out", "unused", *flags])


def test_defaults_and_lists() -> None:
    args = bench_args("--concurrency", "1,8,32", "--num-prompts", "16,16,32", "--request-rate", "2.5")
    plans = _plans(args)
    assert [(p.concurrency, p.num_prompts, p.request_rate) for p in plans] == [(1, 16, 2.5), (8, 16, 2.5),
                                                                                (32, 32, 2.5)]
    assert [p.num_prompts for p in _plans(bench_args("--concurrency", "1,2", "--num-prompts", "5"))] == [5, 5]
    assert [(p.concurrency, p.request_rate) for p in _plans(bench_args())] == [(1, None)]
    assert [(p.concurrency, p.request_rate) for p in _plans(bench_args("--request-rate", "3"))] == [(None, 3.0)]
    args = bench_args()
    assert args.base_url == "http://127.0.0.1:8000" and args.endpoint == "chat" and args.temperature == 0.0
    assert args.spec_methods == ["none", "ngram"] and args.spec_tokens == [2, 4] and not args.sweep


@pytest.mark.parametrize("flags", [["--concurrency", "0"], ["--concurrency", "a,b"], ["--num-prompts", "-1"],
                                   ["--gpu-hour-usd", "1", "--machine-hour-usd", "1"]])
def test_bad_flags_are_rejected_by_argparse(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_args(*flags)
    assert exc.value.code == 2


@pytest.mark.parametrize("flags", [["--concurrency", "1,2", "--num-prompts", "1,2,3"],
                                   ["--extra-body", "[1]"], ["--extra-body", "{bad"]])
def test_bad_values_exit_2_without_a_report(flags: list[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["bench", "--out", str(out), "--base-url", "http://127.0.0.1:9", *flags]) == EXIT_USAGE
    assert not out.exists()


def test_bad_dataset_exits_2(tmp_path: Path) -> None:
    rc = main(["bench", "--out", str(tmp_path / "o"), "--base-url", "http://127.0.0.1:9", "--model", "m",
               "--dataset", f"jsonl:{tmp_path / 'missing.jsonl'}", "--no-progress"])
    assert rc == EXIT_USAGE
