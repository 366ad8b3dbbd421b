"""PNG plots of a report (matplotlib, Agg backend, no display needed).

- ``throughput_vs_concurrency.png``: output tokens/s against concurrency, one line per run;
- ``p99_tpot_vs_concurrency.png``: p99 time per output token at each concurrency, one bar per run;
- ``acceptance_length.png`` (only when some run speculated): mean acceptance length per dataset, and per
  num_spec_tokens for each method (from runs that state their server's k, e.g. a sweep's).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.figure import Figure  # noqa: E402

from specserve.bench.report import run_acceptance  # noqa: E402


def _series_name(label: str, method: str) -> str:
    """A run's label without its "k=N" part, so one server's runs at several k form one line."""
    name = re.sub(r"\s*\bk=\d+\b", "", label).strip(" ,")
    return name or method


def _closed_levels(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Levels with a concurrency to put on the x axis, ordered by it."""
    return sorted((lv for lv in run["levels"] if lv.get("concurrency")), key=lambda lv: lv["concurrency"])


def _concurrency_axis(ax: Any, values: list[int]) -> None:
    if values:
        ax.set_xscale("log", base=2)
        ax.set_xticks(values)
        ax.set_xticklabels([str(v) for v in values])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.grid(True, alpha=0.3)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(report: dict[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs: set[int] = set()
    for run in report["runs"]:
        levels = _closed_levels(run)
        if levels:
            x = [lv["concurrency"] for lv in levels]
            xs.update(x)
            ax.plot(x, [lv["summary"]["output_tok_s"] for lv in levels], marker="o", label=run["label"])
    _concurrency_axis(ax, sorted(xs))
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput vs concurrency")
    if xs:
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_p99_tpot(report: dict[str, Any], path: Path) -> Path:
    runs = [r for r in report["runs"] if _closed_levels(r)]
    conc = sorted({lv["concurrency"] for r in runs for lv in _closed_levels(r)})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(len(runs), 1)
    for j, run in enumerate(runs):
        by_c = {lv["concurrency"]: lv["summary"]["tpot_s"]["p99"] for lv in _closed_levels(run)}
        heights = [(by_c.get(c) or 0.0) * 1e3 for c in conc]
        ax.bar([i + j * width for i in range(len(conc))], heights, width, label=run["label"])
    ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(conc))])
    ax.set_xticklabels([str(c) for c in conc])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("p99 TPOT (ms)")
    ax.set_title("p99 time per output token")
    ax.grid(True, axis="y", alpha=0.3)
    if runs:
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_acceptance(report: dict[str, Any], path: Path) -> Path | None:
    accepted = [(run, acc) for run in report["runs"] if (acc := run_acceptance(run)) is not None
                and acc["mean_acceptance_length"] is not None]
    if not accepted:
        return None
    fig, (ax_ds, ax_k) = plt.subplots(1, 2, figsize=(11, 4.5))
    datasets = sorted({run["dataset"] for run, _ in accepted})
    width = 0.8 / len(accepted)
    for j, (run, acc) in enumerate(accepted):
        x = datasets.index(run["dataset"]) + j * width
        ax_ds.bar([x], [acc["mean_acceptance_length"]], width, label=run["label"])
    ax_ds.set_xticks([i + width * (len(accepted) - 1) / 2 for i in range(len(datasets))])
    ax_ds.set_xticklabels(datasets)
    ax_ds.set_ylabel("mean acceptance length")
    ax_ds.set_title("Mean acceptance length per dataset")
    ax_ds.axhline(1.0, color="grey", lw=0.8)
    ax_ds.set_ylim(0, 1.35 * max(acc["mean_acceptance_length"] for _, acc in accepted))  # room for the legend
    ax_ds.legend(fontsize=7)

    by_series: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for run, acc in accepted:
        server = run.get("server") or {}
        if server.get("num_spec_tokens") is not None:
            key = (_series_name(run["label"], str(server.get("spec_method", "?"))), run["dataset"])
            by_series[key].append((int(server["num_spec_tokens"]), acc["mean_acceptance_length"]))
    for (series, dataset), points in sorted(by_series.items()):
        points.sort()
        ax_k.plot([k for k, _ in points], [al for _, al in points], marker="o", label=f"{series} ({dataset})")
    if by_series:
        ax_k.set_xticks(sorted({k for points in by_series.values() for k, _ in points}))
        ax_k.legend(fontsize=7)
    else:
        ax_k.text(0.5, 0.5, "no run states its num_spec_tokens", ha="center", va="center",
                  transform=ax_k.transAxes)
    ax_k.set_xlabel("num_spec_tokens (k)")
    ax_k.set_ylabel("mean acceptance length")
    ax_k.set_title("Mean acceptance length per k")
    ax_k.grid(True, alpha=0.3)
    return _save(fig, path)


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Every plot the report has data for; returns their paths."""
    paths = [plot_throughput(report, out_dir / "throughput_vs_concurrency.png"),
             plot_p99_tpot(report, out_dir / "p99_tpot_vs_concurrency.png")]
    acceptance = plot_acceptance(report, out_dir / "acceptance_length.png")
    return paths + ([acceptance] if acceptance else [])
