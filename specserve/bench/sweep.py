"""A grid of speculation method x num_spec_tokens x concurrency against specserve servers started here.

Each grid point (``none`` once, then every method at every k) gets its own ``specserve serve`` process on a
loopback port, started, health-checked, measured at every concurrency, and stopped (SIGINT, then SIGKILL).
A server that fails to start is recorded and the sweep moves on. ``find_inflections`` then compares every
method with ``none`` at each concurrency: where does speculation stop paying, in tokens/s and in p99 TPOT?
"""

from __future__ import annotations

import math
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

PAY_MARGIN = 0.02  # a ratio within 2% of 1 is break-even: inside run-to-run noise on a shared machine


@dataclass(frozen=True)
class SweepPoint:
    method: str
    num_spec_tokens: int | None  # None for "none"

    @property
    def label(self) -> str:
        return "none" if self.method == "none" else f"{self.method} k={self.num_spec_tokens}"


def sweep_points(methods: Sequence[str], spec_tokens: Sequence[int]) -> list[SweepPoint]:
    """``none`` first (the baseline, always included), then each method at each k."""
    points = [SweepPoint("none", None)]
    for method in methods:
        if method != "none":
            points += [SweepPoint(method, k) for k in spec_tokens]
    return points


def serve_command(point: SweepPoint, port: int, serve_args: Sequence[str], spec_models: dict[str, str]) -> list[str]:
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--spec-method", point.method, *serve_args]
    if point.num_spec_tokens is not None:
        cmd += ["--num-spec-tokens", str(point.num_spec_tokens)]
    if point.method in spec_models:
        cmd += ["--spec-model", spec_models[point.method]]
    return cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ManagedServer:
    """A ``specserve serve`` subprocess in its own session (a terminal Ctrl-C reaches the sweep, not it), its
    output in ``log_path``; ``start`` returns once ``/health`` answers 200, or raises RuntimeError."""

    def __init__(self, cmd: list[str], port: int, log_path: Path) -> None:
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} before it was ready "
                                   f"(log: {self.log_path}): {self._log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s:g} s (log: {self.log_path})")

    def served_model(self) -> str:
        data = httpx.get(self.base_url + "/v1/models", timeout=10.0, trust_env=False).json()
        return str(data["data"][0]["id"])

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def _log_tail(self, num_chars: int = 800) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------- analysis


def _level_metrics(run: dict[str, Any]) -> dict[int, tuple[float, float | None]]:
    """concurrency -> (output tok/s, p99 TPOT s) over the closed-loop levels of a run."""
    return {lv["concurrency"]: (lv["summary"]["output_tok_s"], lv["summary"]["tpot_s"]["p99"])
            for lv in run["levels"] if lv.get("request_rate") is None and lv.get("concurrency")}


def _crossover(c_lo: int, r_lo: float, c_hi: int, r_hi: float, threshold: float) -> float:
    """Concurrency where a ratio going from r_lo (at c_lo) to r_hi (at c_hi) crosses ``threshold``, linear in
    log2(c)."""
    if r_lo == r_hi:
        return float(c_hi)
    frac = (r_lo - threshold) / (r_lo - r_hi)
    return 2 ** (math.log2(c_lo) + frac * (math.log2(c_hi) - math.log2(c_lo)))


def _inflection(rows: list[tuple[int, float | None]], pays: Any, threshold: float) -> dict[str, Any]:
    """Where a ratio per concurrency (ascending) stops paying for good (``pays(ratio)``; ``threshold``: the
    ratio at which it stops)."""
    known = [(c, r) for c, r in rows if r is not None]
    paying = [c for c, r in known if pays(r)]
    if not known:
        return {"pays_at": [], "stops_paying_at": None, "crossover_concurrency": None, "summary": "no data"}
    # lowest concurrency from which no higher measured concurrency pays again
    stops_at = None
    for i, (c, _r) in enumerate(known):
        if all(not pays(r) for _, r in known[i:]):
            stops_at = c
            break
    crossover = None
    if stops_at is not None and stops_at != known[0][0]:
        i = [c for c, _ in known].index(stops_at)
        (c_lo, r_lo), (c_hi, r_hi) = known[i - 1], known[i]
        crossover = _crossover(c_lo, r_lo, c_hi, r_hi, threshold)
    if stops_at is None:
        summary = f"pays at every measured concurrency (up to {known[-1][0]})"
    elif not paying:
        summary = f"does not pay at any measured concurrency ({known[0][0]}..{known[-1][0]})"
    else:
        summary = (f"pays up to concurrency {max(c for c in paying if c < stops_at)}, stops paying at {stops_at}"
                   + (f" (crossover ~{crossover:.1f})" if crossover else ""))
    return {"pays_at": paying, "stops_paying_at": stops_at, "crossover_concurrency": crossover, "summary": summary}


def find_inflections(runs: Sequence[dict[str, Any]], margin: float = PAY_MARGIN) -> dict[str, Any]:
    """Per method: the best k and its ratios against ``none`` at each concurrency, and where it stops paying.

    Speculation pays when it beats ``none`` by more than ``margin`` (tokens/s ratio > 1 + margin, p99 TPOT ratio
    < 1 - margin); closer than that is break-even, within run-to-run noise. ``runs`` carry
    ``server.spec_method`` and ``server.num_spec_tokens``; one must be ``none``.
    """
    base_run = next((r for r in runs if (r.get("server") or {}).get("spec_method") == "none"), None)
    if base_run is None:
        return {}
    base = _level_metrics(base_run)
    by_method: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        method = (run.get("server") or {}).get("spec_method")
        if method and method != "none":
            by_method.setdefault(method, []).append(run)
    out: dict[str, Any] = {}
    for method, method_runs in by_method.items():
        rows = []
        for c in sorted(base):
            base_tok, base_tpot = base[c]
            cands = []
            for run in method_runs:
                m = _level_metrics(run).get(c)
                if m is not None:
                    tok_ratio = m[0] / base_tok if base_tok else None
                    tpot_ratio = m[1] / base_tpot if (m[1] is not None and base_tpot) else None
                    cands.append((run["server"].get("num_spec_tokens"), tok_ratio, tpot_ratio))
            if not cands:
                continue
            best = max(cands, key=lambda t: -math.inf if t[1] is None else t[1])
            tpots = [t for t in cands if t[2] is not None]
            best_tpot = min(tpots, key=lambda t: t[2]) if tpots else (None, None, None)
            rows.append({"concurrency": c, "best_k": best[0], "tok_s_ratio": best[1],
                         "p99_tpot_ratio": best_tpot[2], "p99_tpot_best_k": best_tpot[0],
                         "all_k": [{"k": k, "tok_s_ratio": t, "p99_tpot_ratio": p} for k, t, p in cands]})
        out[method] = {
            "per_concurrency": rows,
            "tok_s": _inflection([(r["concurrency"], r["tok_s_ratio"]) for r in rows],
                                 lambda r: r > 1.0 + margin, 1.0 + margin),
            "p99_tpot": _inflection([(r["concurrency"], r["p99_tpot_ratio"]) for r in rows],
                                    lambda r: r < 1.0 - margin, 1.0 - margin),
        }
    return out
