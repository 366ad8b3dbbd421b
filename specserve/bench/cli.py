"""``specserve bench``: load-test any OpenAI-compatible server, or (``--sweep``) a grid of specserve servers.

    specserve bench --base-url http://127.0.0.1:8000 --dataset mt_bench --concurrency 1,8,32 \\
        --num-prompts 16,16,32 --max-tokens 128 --out bench-out
    specserve bench --sweep --spec-methods none,ngram --spec-tokens 2,4 --concurrency 1,8,32 --out sweep-out

Exit status: 0 when every request succeeded, 1 when any failed (the report says which and why), 2 for bad
arguments, 130 when interrupted (Ctrl-C writes the partial report first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _str_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root (without /v1); ignored with --sweep, which starts its own servers")
    g.add_argument("--model", default=None, help="model name to send (default: the first id of /v1/models)")
    g.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="/v1/chat/completions (chat template applied by the server) or /v1/completions (raw text)")
    g.add_argument("--label", default=None, help="name of this run in the report (default: model @ base URL)")
    g.add_argument("--server-spec-method", default=None,
                   help="what the server speculates with, recorded for the report (sweeps fill it in)")
    g.add_argument("--server-num-spec-tokens", type=int, default=None,
                   help="the server's num_spec_tokens, recorded for the report (acceptance per k)")
    g.add_argument("--extra-body", default=None, metavar="JSON",
                   help='extra JSON fields for every request, e.g. \'{"speculative": "off"}\'')

    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="mt_bench",
                   help="mt_bench, humaneval, gsm8k, sharegpt (read under --data-dir), or jsonl:PATH")
    g.add_argument("--data-dir", default=None,
                   help="root of the named datasets (default: $SPECSERVE_DATA_DIR)")
    g.add_argument("--concurrency", type=_int_list, default=None, metavar="C[,C...]",
                   help="requests in flight, one level each (default 1); with --request-rate, the in-flight cap "
                        "of each level (default: no cap)")
    g.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="open loop: Poisson arrivals at R requests/s instead of a closed loop")
    g.add_argument("--num-prompts", type=_int_list, default=[32], metavar="N[,N...]",
                   help="requests per level: one value for every level, or one per --concurrency value")
    g.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/specserve extension)")
    g.add_argument("--shuffle", action="store_true", help="take prompts in a seeded random order, not file order")
    g.add_argument("--seed", type=int, default=0, help="seed of --shuffle and of the Poisson arrivals")
    g.add_argument("--warmup-requests", type=int, default=1, help="short unmeasured requests before the first level")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as failed")

    g = p.add_argument_group("output")
    g.add_argument("--out", required=True, help="directory for report.json, report.md and the PNG plots")
    g.add_argument("--append", action="store_true",
                   help="add this run to the report already in --out instead of starting a new one")
    g.add_argument("--tokenizer", default="auto",
                   help="re-count streamed text with: auto, default, none, a .gguf file or an HF directory")
    g.add_argument("--save-text", action="store_true", help="keep each response's text in report.json")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    cost = g.add_mutually_exclusive_group()
    cost.add_argument("--gpu-hour-usd", type=float, default=None, help="price of the GPU machine, USD per hour")
    cost.add_argument("--machine-hour-usd", type=float, default=None, help="price of a CPU machine, USD per hour")

    g = p.add_argument_group("sweep", "start a specserve server per (method, k), measure it, stop it")
    g.add_argument("--sweep", action="store_true", help="run the grid instead of benchmarking --base-url")
    g.add_argument("--spec-methods", type=_str_list, default=["none", "ngram"],
                   help="methods of the grid (none is always measured, as the baseline)")
    g.add_argument("--spec-tokens", type=_int_list, default=[2, 4], help="num_spec_tokens values of the grid")
    g.add_argument("--spec-model", action="append", default=[], metavar="METHOD=PATH",
                   help="--spec-model for a method's servers (draft, eagle3, peagle); repeatable")
    g.add_argument("--serve-args", default="", help="extra `specserve serve` flags for every server (one string)")
    g.add_argument("--server-start-timeout", type=float, default=600.0, help="seconds to wait for /health")


# --------------------------------------------------------------------------------------------- helpers


def _plans(args: argparse.Namespace) -> list[Any]:
    from specserve.bench.load import LevelPlan

    levels: list[int | None] = args.concurrency or [None if args.request_rate is not None else 1]
    counts = args.num_prompts
    if len(counts) not in (1, len(levels)):
        raise ValueError("--num-prompts takes one value or one per --concurrency value")
    if len(counts) == 1:
        counts = counts * len(levels)
    return [LevelPlan(concurrency=c, num_prompts=n, request_rate=args.request_rate) for c, n in zip(levels, counts)]


def _model_from_server(base_url: str) -> str:
    import httpx

    try:
        data = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10.0, trust_env=False).json()
        return str(data["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise ConnectionError(f"could not read the model name from {base_url}/v1/models ({exc}); pass --model") \
            from None


def _cost_basis(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.gpu_hour_usd is not None:
        return {"kind": "gpu", "usd_per_hour": args.gpu_hour_usd}
    if args.machine_hour_usd is not None:
        return {"kind": "machine", "usd_per_hour": args.machine_hour_usd}
    return None


def _command_line(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["specserve", *args]) if args[:1] == ["bench"] else shlex.join(["specserve", "bench", *args])


def _exit_status(runs: list[dict[str, Any]], interrupted: bool) -> int:
    if interrupted:
        return EXIT_INTERRUPTED
    failed = any(lv["summary"]["num_errors"] for run in runs for lv in run["levels"])
    return EXIT_FAILED_REQUESTS if failed or any(run.get("error") for run in runs) else EXIT_OK


def _install_stop(stop: asyncio.Event) -> Callable[[], None]:
    """Ctrl-C (and SIGTERM) set ``stop`` instead of killing the process; returns an uninstaller."""
    loop = asyncio.get_running_loop()
    installed = []

    def on_signal() -> None:
        if not stop.is_set():
            print("\nstopping: finishing the report with what has been measured ...", file=sys.stderr)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass

    def uninstall() -> None:
        for sig in installed:
            loop.remove_signal_handler(sig)

    return uninstall


# ------------------------------------------------------------------------------------------------- main


def main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run ``specserve bench`` with parsed ``args``; returns the exit status."""
    from specserve.bench.report import load_report, new_report

    out = Path(args.out)
    try:
        plans = _plans(args)
        extra_body = json.loads(args.extra_body) if args.extra_body else {}
        if not isinstance(extra_body, dict):
            raise ValueError("--extra-body must be a JSON object")
        report = load_report(out / "report.json") if args.append and (out / "report.json").exists() \
            else new_report()
    except (ValueError, OSError) as exc:
        print(f"specserve bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return asyncio.run(_amain(args, plans, extra_body, report, _command_line(argv)))


async def _amain(args: argparse.Namespace, plans: list[Any], extra_body: dict[str, Any], report: dict[str, Any],
                 command: str) -> int:
    from specserve.bench.report import write_report

    stop = asyncio.Event()
    uninstall = _install_stop(stop)
    out = Path(args.out)
    first_new_run = len(report["runs"])

    def save(run: dict[str, Any] | None = None) -> None:
        runs = report["runs"][:first_new_run] + new_runs + ([run] if run is not None else [])
        write_report({**report, "runs": runs}, out)

    new_runs: list[dict[str, Any]] = []
    try:
        if args.sweep:
            from specserve.bench.sweep_runner import run_sweep
            sweep = await run_sweep(args, plans, extra_body, command, stop, new_runs, save)
            report["sweep"] = sweep
        else:
            run = await bench_one(args, plans, extra_body, command, stop, save, args.base_url, args.model)
            new_runs.append(run)
    except (ValueError, ConnectionError) as exc:
        print(f"specserve bench: error: {exc}", file=sys.stderr)
        if not new_runs:
            return EXIT_USAGE
    finally:
        uninstall()
    report["runs"] = report["runs"][:first_new_run] + new_runs
    paths = write_report(report, out)
    _print_summary(new_runs, paths)
    return _exit_status(new_runs, stop.is_set() or any(r.get("interrupted") for r in new_runs))


async def bench_one(args: argparse.Namespace, plans: list[Any], extra_body: dict[str, Any], command: str,
                     stop: asyncio.Event, save: Callable[[dict[str, Any] | None], None], base_url: str,
                     model: str | None, server: dict[str, Any] | None = None, label: str | None = None
                     ) -> dict[str, Any]:
    """Measure one server; a server that cannot be reached still gets a run whose requests all failed."""
    from specserve.bench.client import RequestSpec
    from specserve.bench.cost import load_api_prices
    from specserve.bench.datasets import load_prompts
    from specserve.bench.machine import machine_info
    from specserve.bench.runner import RunConfig, run_benchmark
    from specserve.bench.tokens import resolve_token_counter

    prompts = load_prompts(args.dataset, args.data_dir)
    dataset = prompts[0].dataset
    model_error = None
    if model is None:
        try:
            model = await asyncio.to_thread(_model_from_server, base_url)
        except ConnectionError as exc:  # measured anyway: every request will record why it failed
            model, model_error = "unknown", str(exc)
    count_tokens, tokenizer_desc = resolve_token_counter(args.tokenizer, model)
    server = server if server is not None else {"spec_method": args.server_spec_method,
                                                "num_spec_tokens": args.server_num_spec_tokens}
    cfg = RunConfig(
        base_url=base_url, model=model, dataset=dataset, prompts=prompts, plans=plans,
        request=RequestSpec(model=model, max_tokens=args.max_tokens, temperature=args.temperature,
                            endpoint=args.endpoint, ignore_eos=args.ignore_eos, extra_body=extra_body),
        label=label or args.label or f"{model} @ {base_url}", command=command, timeout_s=args.request_timeout,
        shuffle=args.shuffle, seed=args.seed, warmup_requests=args.warmup_requests, count_tokens=count_tokens,
        tokenizer_desc=tokenizer_desc, save_text=args.save_text, server=server, cost_basis=_cost_basis(args),
        api_prices=load_api_prices(), progress=not args.no_progress, machine=machine_info())
    run = await run_benchmark(cfg, stop, on_level_done=save)
    if model_error:
        run["error"] = model_error
    return run


def _print_summary(runs: list[dict[str, Any]], paths: list[Path]) -> None:
    from specserve.bench.report import level_key

    for run in runs:
        print(f"{run['label']} ({run['dataset']}):")
        for lv in run["levels"]:
            s = lv["summary"]
            p99 = s["tpot_s"]["p99"]
            acc = lv.get("acceptance")
            print(f"  {level_key(lv):>16}: {s['num_ok']}/{s['num_requests']} ok, {s['output_tok_s']:.1f} out tok/s, "
                  f"p99 TPOT {'-' if p99 is None else f'{p99 * 1e3:.0f} ms'}"
                  + (f", AL {acc['mean_acceptance_length']:.2f}" if acc and acc['mean_acceptance_length'] else "")
                  + (f", {s['num_errors']} failed" if s["num_errors"] else ""))
        if run.get("error"):
            print(f"  error: {run['error']}")
    print("wrote " + ", ".join(str(p) for p in paths))
