"""One benchmark run: a server, a dataset, and one level per concurrency (or request rate), in order.

Around each level it scrapes ``/metrics`` (speculation counters, for servers whose responses do not carry
``usage.speculative``), then summarises the level and hands the run so far to ``on_level_done`` so a caller
can write a partial report after every level.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from specserve.bench.client import RequestResult, RequestSpec, TokenCounter, send_request
from specserve.bench.cost import level_cost
from specserve.bench.datasets import BenchPrompt, select_prompts
from specserve.bench.load import LevelPlan, LevelRunner
from specserve.bench.server_metrics import counter_delta, scrape_spec_counters
from specserve.bench.stats import acceptance_from_usage, choose_acceptance, summarize_level


@dataclass
class RunConfig:
    base_url: str
    model: str
    dataset: str  # the name reported
    prompts: list[BenchPrompt]  # every prompt of the dataset; each level takes its first num_prompts
    plans: list[LevelPlan]
    request: RequestSpec
    label: str
    command: str
    timeout_s: float = 600.0
    shuffle: bool = False
    seed: int = 0
    warmup_requests: int = 1
    count_tokens: TokenCounter | None = None
    tokenizer_desc: str = "none"
    save_text: bool = False
    server: dict[str, Any] = field(default_factory=dict)  # what the server runs, as far as the caller knows
    cost_basis: dict[str, Any] | None = None  # {"kind": "gpu" | "machine", "usd_per_hour": float}
    api_prices: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    machine: dict[str, Any] = field(default_factory=dict)


def new_run(cfg: RunConfig) -> dict[str, Any]:
    return {"label": cfg.label, "command": cfg.command, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "base_url": cfg.base_url, "model": cfg.model, "endpoint": cfg.request.endpoint, "dataset": cfg.dataset,
            "max_tokens": cfg.request.max_tokens, "temperature": cfg.request.temperature,
            "ignore_eos": cfg.request.ignore_eos, "extra_body": cfg.request.extra_body, "seed": cfg.seed,
            "shuffle": cfg.shuffle, "timeout_s": cfg.timeout_s, "tokenizer": cfg.tokenizer_desc,
            "server": cfg.server, "cost_basis": cfg.cost_basis, "machine": cfg.machine, "interrupted": False,
            "warmup": [], "levels": []}


def http_client(max_connections: int) -> httpx.AsyncClient:
    """A client that ignores proxy settings (benchmarks talk to the server directly) and allows enough
    connections for every request in flight."""
    limits = httpx.Limits(max_connections=max_connections + 4, max_keepalive_connections=max_connections + 4)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=10.0), trust_env=False)


async def run_benchmark(cfg: RunConfig, stop: asyncio.Event,
                        on_level_done: Callable[[dict[str, Any]], None] = lambda run: None) -> dict[str, Any]:
    """Measure every level of ``cfg``; returns the run (also passed to ``on_level_done`` after each level)."""
    run = new_run(cfg)
    max_in_flight = max((p.concurrency or p.num_prompts) for p in cfg.plans)
    async with http_client(max_in_flight) as client:
        await _warm_up(client, cfg, run)
        runner = LevelRunner(client, cfg.base_url, cfg.request, timeout_s=cfg.timeout_s,
                             count_tokens=cfg.count_tokens, save_text=cfg.save_text, seed=cfg.seed)
        for plan in cfg.plans:
            if stop.is_set():
                run["interrupted"] = True
                break
            prompts = select_prompts(cfg.prompts, plan.num_prompts, shuffle=cfg.shuffle, seed=cfg.seed)
            before = await scrape_spec_counters(client, cfg.base_url)
            with _Progress(f"{cfg.label} {_plan_name(plan)}", plan.num_prompts, cfg.progress) as progress:
                level_run = await runner.run(prompts, plan, stop, on_done=progress.update)
            after = await scrape_spec_counters(client, cfg.base_url)
            run["levels"].append(_level_record(cfg, plan, level_run.results, level_run.duration_s,
                                               level_run.interrupted, before, after))
            run["interrupted"] = run["interrupted"] or level_run.interrupted
            on_level_done(run)
    return run


def _plan_name(plan: LevelPlan) -> str:
    return f"c={plan.concurrency}" if plan.request_rate is None else f"rate={plan.request_rate:g}/s"


def _level_record(cfg: RunConfig, plan: LevelPlan, results: list[RequestResult], duration_s: float,
                  interrupted: bool, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    summary = summarize_level(results, duration_s)
    from_usage = acceptance_from_usage(results)
    from_metrics = counter_delta(before, after)
    scrape_errors = [s["error"] for s in (before, after) if "error" in s]
    return {"concurrency": plan.concurrency, "request_rate": plan.request_rate, "num_prompts": plan.num_prompts,
            "interrupted": interrupted, "summary": summary,
            "acceptance": choose_acceptance(from_usage, from_metrics),
            "acceptance_from_usage": from_usage, "acceptance_from_metrics": from_metrics,
            "metrics_scrape_errors": scrape_errors,
            "cost": level_cost(cfg.cost_basis["usd_per_hour"] if cfg.cost_basis else None, summary["output_tok_s"],
                               cfg.api_prices),
            "requests": [r.to_json() for r in results]}


async def _warm_up(client: httpx.AsyncClient, cfg: RunConfig, run: dict[str, Any]) -> None:
    """A few short requests before measuring (first-request costs: kernel builds, caches); kept apart."""
    short = replace(cfg.request, max_tokens=min(16, cfg.request.max_tokens))
    for i in range(cfg.warmup_requests):
        prompt = cfg.prompts[i % len(cfg.prompts)]
        result = await send_request(client, cfg.base_url, short, prompt, RequestResult(index=i, dataset_row=prompt.row),
                                    timeout_s=cfg.timeout_s)
        run["warmup"].append({"ok": result.ok, "error": result.error, "e2e_s": result.e2e_s})


class _Progress:
    """A one-line progress bar on stderr (tqdm): requests done, errors, output tokens/s so far."""

    def __init__(self, desc: str, total: int, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.errors = 0
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, unit="req", mininterval=0.5, leave=True)

    def update(self, result: RequestResult) -> None:
        if result.ok:
            self.tokens += result.output_tokens
        else:
            self.errors += 1
        if self.bar is not None:
            elapsed = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix(errors=self.errors, tok_s=f"{self.tokens / elapsed:.1f}", refresh=False)
            self.bar.update(1)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
