"""The benchmark report: ``report.json`` (every raw per-request number), ``report.md`` and the PNG plots.

A report holds runs; a run is one server x dataset x load pattern, measured at one or more levels
(concurrency, or request rate). ``--append`` adds runs to an existing report, so one report can compare
servers measured by separate commands.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from specserve.bench.cost import load_api_prices
from specserve.bench.stats import acceptance_from_counts

SCHEMA = "specserve.bench.report/1"


def new_report() -> dict[str, Any]:
    now = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return {"schema": SCHEMA, "created": now, "updated": now, "runs": [], "api_prices": load_api_prices()}


def load_report(path: Path) -> dict[str, Any]:
    report = json.loads(path.read_text())
    if report.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a {SCHEMA} report")
    return report


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write report.json, report.md and the plots into ``out_dir``; return the paths written."""
    from specserve.bench.plots import write_plots

    out_dir.mkdir(parents=True, exist_ok=True)
    report["updated"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    report["plots"] = [p.name for p in write_plots(report, out_dir)]
    json_path = out_dir / "report.json"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, separators=(",", ":")))  # compact: thousands of raw per-chunk times
    tmp.replace(json_path)  # a reader never sees half a file, even if the run is killed mid-write
    md_path = out_dir / "report.md"
    md_path.write_text(render_markdown(report))
    return [json_path, md_path, *(out_dir / name for name in report["plots"])]


# --------------------------------------------------------------------------------------------- queries


def run_acceptance(run: dict[str, Any]) -> dict[str, Any] | None:
    """Acceptance over all levels of a run (counts summed), with the source(s) it came from."""
    levels = [lv["acceptance"] for lv in run["levels"] if lv.get("acceptance")]
    if not levels:
        return None
    total = acceptance_from_counts(sum(a["num_drafts"] for a in levels), sum(a["draft_tokens"] for a in levels),
                                   sum(a["accepted_tokens"] for a in levels))
    return {**total, "source": ", ".join(sorted({a["source"] for a in levels}))}


def level_key(level: dict[str, Any]) -> str:
    """How a level is named in tables: its concurrency, or its request rate (with the cap, if any)."""
    if level.get("request_rate") is None:
        return f"c={level['concurrency']}"
    cap = f", c<={level['concurrency']}" if level.get("concurrency") else ""
    return f"{level['request_rate']:g} req/s{cap}"


# ------------------------------------------------------------------------------------------- markdown


def _ms(stats: dict[str, Any], *keys: str) -> str:
    vals = [stats.get(k) for k in keys]
    return " / ".join("-" if v is None else f"{v * 1e3:.0f}" for v in vals)


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def render_markdown(report: dict[str, Any]) -> str:
    lines = ["# specserve bench report", "",
             f"Created {report['created']}, updated {report['updated']}. Raw per-request numbers: `report.json`.", ""]
    for run in report["runs"]:
        lines += _run_section(run)
    if len(report["runs"]) > 1:
        lines += _comparison_section(report["runs"])
    lines += _acceptance_section(report["runs"])
    lines += _cost_section(report)
    if report.get("sweep"):
        lines += _sweep_section(report["sweep"])
    if report.get("plots"):
        lines += ["## Plots", ""] + [f"![{name}]({name})" for name in report["plots"]] + [""]
    return "\n".join(lines)


def _run_section(run: dict[str, Any]) -> list[str]:
    server = run.get("server") or {}
    spec = ", ".join(f"{k}={v}" for k, v in server.items() if v is not None) or "not stated"
    lines = [f"## {run['label']}", "",
             f"`{run['base_url']}` model `{run['model']}`, {run['endpoint']} endpoint, dataset **{run['dataset']}**, "
             f"max_tokens {run['max_tokens']}, temperature {run['temperature']:g}"
             f"{', ignore_eos' if run.get('ignore_eos') else ''}; server speculation: {spec}; "
             f"stream tokens re-counted with: {run.get('tokenizer', 'none')}.", "",
             "```", run["command"], "```", ""]
    if run.get("interrupted"):
        lines += ["**Interrupted**: this run was stopped early; the levels below are what finished.", ""]
    if run.get("error"):
        lines += [f"**Run error**: {run['error']}", ""]
    lines += ["| level | ok / sent | out tok/s | req/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | "
              "ITL p50/p90/p99 ms | E2E p50/p99 ms | out tok/req | AL | accept | $/1M out |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for lv in run["levels"]:
        s, acc, cost = lv["summary"], lv.get("acceptance"), lv.get("cost")
        lines.append(
            f"| {level_key(lv)} | {s['num_ok']} / {s['num_requests']} | {s['output_tok_s']:.1f} | "
            f"{s['requests_per_s']:.2f} | {_ms(s['ttft_s'], 'p50', 'p90', 'p99')} | "
            f"{_ms(s['tpot_s'], 'p50', 'p90', 'p99')} | {_ms(s['itl_s'], 'p50', 'p90', 'p99')} | "
            f"{_ms(s['e2e_s'], 'p50', 'p99')} | {_num(s['mean_output_tokens'])} | "
            f"{_num(acc and acc['mean_acceptance_length'], '.2f')} | {_num(acc and acc['acceptance_rate'], '.2f')} | "
            f"{_num(cost and cost['usd_per_million_output_tokens'], '.2f')} |")
        if s["num_errors"]:
            kinds = ", ".join(f"{k} x{n}" for k, n in s["errors_by_kind"].items())
            first = next((r["error"] for r in lv["requests"] if r.get("error")), "")
            notes.append(f"- {level_key(lv)}: **{s['num_errors']} request(s) failed** ({kinds}); first: `{first}`")
        tc = s["token_count"]
        if tc["mismatches"]:
            notes.append(f"- {level_key(lv)}: stream token count != usage for {tc['mismatches']} of {tc['checked']} "
                         f"requests ({tc['stream_tokens']} streamed vs {tc['usage_tokens']} reported; re-tokenizing "
                         "text can merge tokens a model emitted apart, so a token or two on a few requests is "
                         "expected, a steady gap is not)")
        if tc["missing_usage"]:
            notes.append(f"- {level_key(lv)}: {tc['missing_usage']} response(s) without usage (chunks counted)")
    lines += [""] + (notes + [""] if notes else [])
    return lines


def _comparison_section(runs: list[dict[str, Any]]) -> list[str]:
    keys: list[str] = []
    for run in runs:
        for lv in run["levels"]:
            if level_key(lv) not in keys:
                keys.append(level_key(lv))
    header = "| run | " + " | ".join(keys) + " |"
    rule = "|---|" + "---|" * len(keys)

    def table(title: str, cell: Any) -> list[str]:
        rows = [f"### {title}", "", header, rule]
        for run in runs:
            by_key = {level_key(lv): lv for lv in run["levels"]}
            rows.append(f"| {run['label']} | " + " | ".join(cell(by_key[k]) if k in by_key else "-" for k in keys)
                        + " |")
        return rows + [""]

    return (["## Comparison", ""]
            + table("Output tokens/s", lambda lv: f"{lv['summary']['output_tok_s']:.1f}")
            + table("p99 TPOT (ms)", lambda lv: _ms(lv["summary"]["tpot_s"], "p99"))
            + table("p99 TTFT (ms)", lambda lv: _ms(lv["summary"]["ttft_s"], "p99")))


def _acceptance_section(runs: list[dict[str, Any]]) -> list[str]:
    rows = []
    for run in runs:
        acc = run_acceptance(run)
        if acc is not None:
            k = (run.get("server") or {}).get("num_spec_tokens")
            rows.append(f"| {run['label']} | {run['dataset']} | {'-' if k is None else k} | "
                        f"{_num(acc['mean_acceptance_length'], '.2f')} | {_num(acc['acceptance_rate'], '.3f')} | "
                        f"{acc['num_drafts']:.0f} | {acc['source']} |")
    if not rows:
        return ["## Acceptance", "", "No run reported speculative decoding (no usage.speculative and no "
                "spec_decode counters moved).", ""]
    return (["## Acceptance per dataset", "",
             "Mean acceptance length (AL) = 1 + accepted / drafts; acceptance rate = accepted / drafted.", "",
             "| run | dataset | k | AL | acceptance rate | drafts | source |", "|---|---|---|---|---|---|---|"]
            + rows + [""])


def _cost_section(report: dict[str, Any]) -> list[str]:
    prices = report.get("api_prices") or {}
    lines = ["## Cost per 1M output tokens", ""]
    bases = {(r.get("cost_basis") or {}).get("kind") for r in report["runs"] if r.get("cost_basis")}
    if bases:
        for run in report["runs"]:
            basis = run.get("cost_basis")
            if basis:
                costs = ", ".join(f"{level_key(lv)}: ${lv['cost']['usd_per_million_output_tokens']:.2f}"
                                  for lv in run["levels"]
                                  if lv.get("cost") and lv["cost"]["usd_per_million_output_tokens"] is not None)
                lines.append(f"- {run['label']} at ${basis['usd_per_hour']:g}/{basis['kind']}-hour: {costs or '-'}")
        lines.append("")
    else:
        lines += ["No --gpu-hour-usd / --machine-hour-usd given, so no cost was computed.", ""]
    if prices.get("prices"):
        lines += [f"Hosted-API list prices (read {prices.get('read_on', '?')}; {prices.get('how_read', '')}):", "",
                  "| provider | model | output $/1M | input $/1M | status | source |", "|---|---|---|---|---|---|"]
        lines += [f"| {p['provider']} | {p['model']} | {p['output_usd_per_mtok']:g} | {p['input_usd_per_mtok']:g} | "
                  f"{p['status']} | {p['source']} |" for p in prices["prices"]]
        lines.append("")
    return lines


def _sweep_section(sweep: dict[str, Any]) -> list[str]:
    lines = ["## Sweep: where speculation stops paying", "",
             "Ratios against the no-speculation server at the same concurrency: tokens/s (pays above 1.02) and "
             "p99 TPOT (pays below 0.98; within 2% of 1 is break-even). `stops paying at` is the lowest measured "
             "concurrency from which the best k no longer pays; `crossover ~` interpolates (in log2 concurrency) "
             "where the ratio crosses that line.", "",
             "| method | concurrency | best k | tok/s ratio | p99 TPOT ratio |", "|---|---|---|---|---|"]
    for method, info in sweep.get("inflection", {}).items():
        for row in info["per_concurrency"]:
            lines.append(f"| {method} | {row['concurrency']} | {row['best_k']} | {_num(row['tok_s_ratio'], '.2f')} | "
                         f"{_num(row['p99_tpot_ratio'], '.2f')} |")
    lines += [""]
    for method, info in sweep.get("inflection", {}).items():
        for metric, name in (("tok_s", "tokens/s"), ("p99_tpot", "p99 TPOT")):
            point = info[metric]
            lines.append(f"- **{method}**, {name}: {point['summary']}")
    failed = [f"- {c['label']}: {c['error']}" for c in sweep.get("configs", []) if c.get("error")]
    return lines + [""] + (["Configurations that did not run:", *failed, ""] if failed else [])
