"""Sweep planning and the inflection analysis: where speculation stops paying against no speculation."""

from __future__ import annotations

import sys

import pytest

from specserve.bench.sweep import SweepPoint, find_inflections, serve_command, sweep_points


def level(c: int, tok_s: float, p99_tpot_s: float) -> dict:
    return {"concurrency": c, "request_rate": None, "summary": {"output_tok_s": tok_s, "tpot_s": {"p99": p99_tpot_s}}}


def run(method: str, k: int | None, points: dict[int, tuple[float, float]]) -> dict:
    return {"server": {"spec_method": method, "num_spec_tokens": k},
            "levels": [level(c, t, p) for c, (t, p) in points.items()]}


BASE = run("none", None, {1: (40.0, 0.030), 8: (100.0, 0.090), 32: (140.0, 0.250)})


def test_points_put_the_baseline_first() -> None:
    assert sweep_points(["ngram", "none", "draft"], [2, 4]) == [
        SweepPoint("none", None), SweepPoint("ngram", 2), SweepPoint("ngram", 4), SweepPoint("draft", 2),
        SweepPoint("draft", 4)]
    assert [p.label for p in sweep_points(["ngram"], [3])] == ["none", "ngram k=3"]


def test_serve_command() -> None:
    cmd = serve_command(SweepPoint("draft", 3), 8123, ["--max-num-seqs", "8"], {"draft": "self"})
    assert cmd[:4] == [sys.executable, "-m", "specserve.cli", "serve"]
    joined = " ".join(cmd)
    assert "--port 8123" in joined and "--spec-method draft" in joined and "--num-spec-tokens 3" in joined
    assert "--spec-model self" in joined and "--max-num-seqs 8" in joined
    assert "--num-spec-tokens" not in serve_command(SweepPoint("none", None), 1, [], {})


def test_speculation_that_stops_paying() -> None:
    runs = [BASE,
            run("ngram", 2, {1: (60.0, 0.020), 8: (110.0, 0.085), 32: (120.0, 0.300)}),
            run("ngram", 4, {1: (70.0, 0.018), 8: (90.0, 0.100), 32: (100.0, 0.350)})]
    info = find_inflections(runs)["ngram"]
    rows = {r["concurrency"]: r for r in info["per_concurrency"]}
    assert rows[1]["best_k"] == 4 and rows[1]["tok_s_ratio"] == pytest.approx(70 / 40)
    assert rows[8]["best_k"] == 2 and rows[8]["tok_s_ratio"] == pytest.approx(1.1)
    assert rows[1]["p99_tpot_ratio"] == pytest.approx(0.018 / 0.030) and rows[1]["p99_tpot_best_k"] == 4
    assert rows[32]["p99_tpot_ratio"] == pytest.approx(0.300 / 0.250)
    tok = info["tok_s"]
    assert tok["pays_at"] == [1, 8] and tok["stops_paying_at"] == 32
    # ratio 1.1 at c=8 and 120/140 at c=32: crosses the 1.02 line at log2 c = 3 + 2 * 0.08 / (1.1 - 120/140)
    assert tok["crossover_concurrency"] == pytest.approx(2 ** (3 + 2 * 0.08 / (1.1 - 120 / 140)))
    assert "stops paying at 32" in tok["summary"]
    assert info["p99_tpot"]["stops_paying_at"] == 32


def test_speculation_that_always_or_never_pays() -> None:
    always = find_inflections([BASE, run("eagle3", 3, {1: (80.0, 0.01), 8: (200.0, 0.05), 32: (150.0, 0.2)})])
    assert always["eagle3"]["tok_s"]["stops_paying_at"] is None
    assert "every measured concurrency" in always["eagle3"]["tok_s"]["summary"]
    never = find_inflections([BASE, run("draft", 3, {1: (30.0, 0.05), 8: (50.0, 0.2), 32: (60.0, 0.5)})])
    assert never["draft"]["tok_s"]["stops_paying_at"] == 1 and never["draft"]["tok_s"]["pays_at"] == []
    assert "does not pay" in never["draft"]["tok_s"]["summary"]


def test_a_dip_that_recovers_is_not_the_inflection() -> None:
    runs = [BASE, run("ngram", 2, {1: (50.0, 0.02), 8: (90.0, 0.1), 32: (150.0, 0.2)})]
    assert find_inflections(runs)["ngram"]["tok_s"]["stops_paying_at"] is None


def test_no_baseline_no_analysis() -> None:
    assert find_inflections([run("ngram", 2, {1: (1.0, 1.0)})]) == {}


def test_break_even_within_the_margin_does_not_pay() -> None:
    runs = [BASE, run("ngram", 4, {1: (50.0, 0.02), 8: (100.5, 0.0895), 32: (141.0, 0.249)})]
    info = find_inflections(runs)["ngram"]
    assert info["tok_s"]["pays_at"] == [1] and info["tok_s"]["stops_paying_at"] == 8
    assert info["p99_tpot"]["stops_paying_at"] == 8
    assert find_inflections(runs, margin=0.0)["ngram"]["tok_s"]["stops_paying_at"] is None
