"""Load patterns over one set of prompts: a closed loop at fixed concurrency, or an open loop of Poisson arrivals.

Closed loop: ``concurrency`` workers, each sending its next prompt as soon as its previous response ends, so
exactly ``concurrency`` requests are in flight until the prompts run out. Open loop: request i arrives at
t_i = sum of i exponential gaps of mean 1 / ``request_rate`` (t_0 = 0; seeded), whether or not earlier ones have
finished; ``concurrency`` then caps how many are in flight (an arrival that finds the cap full waits, and its
wait shows as ``start_s - scheduled_s``).

Setting ``stop`` ends a level early: requests in flight are cancelled and reported with an "interrupted" error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from specserve.bench.client import RequestResult, RequestSpec, TokenCounter, send_request
from specserve.bench.datasets import BenchPrompt

INTERRUPTED = "interrupted: the run was stopped before this request finished"


@dataclass(frozen=True)
class LevelPlan:
    concurrency: int | None  # in-flight cap; None: unlimited (open loop only)
    num_prompts: int
    request_rate: float | None = None  # requests/s of the open loop; None: closed loop

    def __post_init__(self) -> None:
        if self.request_rate is None and (self.concurrency is None or self.concurrency < 1):
            raise ValueError("a closed loop needs concurrency >= 1")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("--request-rate must be > 0")


@dataclass
class LevelRun:
    results: list[RequestResult]
    duration_s: float
    interrupted: bool


def poisson_arrivals(num_requests: int, request_rate: float, seed: int) -> np.ndarray:
    """Arrival times (s) of a Poisson process at ``request_rate``, the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps)


@dataclass
class LevelRunner:
    """Everything a level needs besides its plan and prompts."""

    client: httpx.AsyncClient
    base_url: str
    spec: RequestSpec
    timeout_s: float = 600.0
    count_tokens: TokenCounter | None = None
    save_text: bool = False
    seed: int = 0

    async def run(self, prompts: Sequence[BenchPrompt], plan: LevelPlan, stop: asyncio.Event,
                  on_done: Callable[[RequestResult], None] = lambda r: None) -> LevelRun:
        results = [RequestResult(index=i, dataset_row=p.row) for i, p in enumerate(prompts)]
        in_flight: set[int] = set()
        finished: set[int] = set()
        t0 = time.perf_counter()
        last_end = [t0]

        async def one(i: int) -> None:
            result = results[i]
            result.start_s = time.perf_counter() - t0
            if plan.request_rate is None:
                result.scheduled_s = result.start_s  # closed loop: due the moment a worker is free
            in_flight.add(i)
            await send_request(self.client, self.base_url, self.spec, prompts[i], result, timeout_s=self.timeout_s,
                               count_tokens=self.count_tokens, save_text=self.save_text)
            in_flight.discard(i)
            finished.add(i)
            last_end[0] = time.perf_counter()
            on_done(result)

        if plan.request_rate is None:
            work = self._closed_loop(results, plan, one)
        else:
            work = self._open_loop(results, plan, one, t0)
        main = asyncio.ensure_future(work)
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({main, stopper}, return_when=asyncio.FIRST_COMPLETED)
        interrupted = not main.done()
        stopper.cancel()
        if interrupted:
            main.cancel()
            await asyncio.gather(main, return_exceptions=True)
            last_end[0] = time.perf_counter()
        else:
            main.result()  # a bug in the loop itself should surface, not vanish
        for i in in_flight:
            results[i].error, results[i].ok = INTERRUPTED, False
            finished.add(i)
        done = [r for r in results if r.index in finished]
        return LevelRun(results=done, duration_s=last_end[0] - t0, interrupted=interrupted)

    @staticmethod
    async def _closed_loop(results: list[RequestResult], plan: LevelPlan,
                           one: Callable[[int], object]) -> None:
        next_index = iter(range(len(results)))

        async def worker() -> None:
            for i in next_index:  # shared iterator: each index is taken by exactly one worker
                await one(i)  # type: ignore[misc]

        assert plan.concurrency is not None
        await asyncio.gather(*(worker() for _ in range(min(plan.concurrency, len(results)))))

    async def _open_loop(self, results: list[RequestResult], plan: LevelPlan, one: Callable[[int], object],
                         t0: float) -> None:
        assert plan.request_rate is not None
        arrivals = poisson_arrivals(len(results), plan.request_rate, self.seed)
        cap = asyncio.Semaphore(plan.concurrency) if plan.concurrency else None

        async def arrive(i: int) -> None:
            if cap is None:
                await one(i)  # type: ignore[misc]
                return
            async with cap:
                await one(i)  # type: ignore[misc]

        tasks = []
        try:
            for i, due in enumerate(arrivals):
                delay = t0 + float(due) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                results[i].scheduled_s = float(due)
                tasks.append(asyncio.ensure_future(arrive(i)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
