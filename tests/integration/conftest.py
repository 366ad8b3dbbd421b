"""Fixtures for server tests: a live specserve HTTP server on a free loopback port.

Every server test runs twice: against the real engine serving SmolLM2-135M-Instruct (the default model,
fp32 on CPU) and against the deterministic fake in ``fake_engine.py`` (which can also inject failures).
``SPECSERVE_TEST_ENGINE_FACTORY=package.module:function`` swaps in another engine for the real one.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from specserve.config import SpecConfig
from specserve.server.api import build_app
from specserve.server.launch import start_server_in_thread
from specserve.server.metrics import ServingMetrics

from .fake_engine import FakeAsyncEngine

MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024


def make_real_async_engine(speculative: SpecConfig | None = None, async_scheduling: bool | None = None) -> Any:
    """The real engine over the default model, sized for CPU tests; ``speculative``: the server's default
    speculation (off when None); ``async_scheduling``: asynchronous decode steps (None: the device's default,
    off on CPU)."""
    from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.engine import LLMEngine
    from specserve.models.fetch import DEFAULT_MODEL_NAME as name

    cfg = EngineConfig(model="default", dtype="float32", device="cpu", cache=CacheConfig(num_blocks=512),
                       scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=16,
                                                 async_scheduling=async_scheduling),
                       speculative=speculative or SpecConfig())
    engine = LLMEngine.from_config(cfg)
    metrics = ServingMetrics(name, max_model_len=engine.max_model_len, spec_methods=list(engine.proposers))
    return AsyncEngine(engine, metrics, model_name=name)


def make_async_engine(kind: str) -> Any:
    """The engine the server tests run against (see the module docstring)."""
    if kind == "fake":
        metrics = ServingMetrics("fake-model", spec_methods=["ngram"])
        return FakeAsyncEngine(model_name="fake-model", max_model_len=2048, metrics=metrics)
    factory_path = os.environ.get("SPECSERVE_TEST_ENGINE_FACTORY")
    if factory_path:
        module_name, _, func_name = factory_path.partition(":")
        return getattr(importlib.import_module(module_name), func_name)()
    return make_real_async_engine()


@dataclass
class LiveServer:
    base_url: str
    engine: Any
    model: str

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"


def live_server(engine: Any) -> Iterator[LiveServer]:
    """Serve ``engine`` on a free loopback port for the duration of a fixture."""
    app = build_app(engine, engine.model_name, max_request_body_bytes=MAX_REQUEST_BODY_BYTES)
    base_url, stop = start_server_in_thread(app)
    try:
        yield LiveServer(base_url=base_url, engine=engine, model=engine.model_name)
    finally:
        stop()


def client(server: LiveServer, **kwargs: Any) -> openai.OpenAI:
    """The official OpenAI client, pointed at ``server``."""
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, **kwargs)


def concurrent_chat(server: LiveServer, requests: list[dict]) -> list[tuple[str, str | None]]:
    """Send every chat request (``create`` keyword arguments without ``model``) at once with the async OpenAI
    client, the odd-numbered ones streamed; returns (text, finish_reason) per request, in order."""
    async def run() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=server.api_url, api_key="unused", max_retries=0) as ac:
            async def one(i: int, kw: dict) -> tuple[str, str | None]:
                if i % 2:
                    stream = await ac.chat.completions.create(model=server.model, **kw, stream=True)
                    text, finish = "", None
                    async for ch in stream:
                        if ch.choices:
                            text += ch.choices[0].delta.content or ""
                            finish = ch.choices[0].finish_reason or finish
                    return text, finish
                resp = await ac.chat.completions.create(model=server.model, **kw)
                return resp.choices[0].message.content, resp.choices[0].finish_reason

            return await asyncio.gather(*(one(i, kw) for i, kw in enumerate(requests)))

    return asyncio.run(run())


def wait_until(cond: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def metric_value(server: LiveServer, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    text = httpx.get(f"{server.base_url}/metrics").text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        label_text, value = line[len(name) + 1:].rsplit("} ", 1)
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total


@pytest.fixture(scope="module", params=["real", "fake"])
def server(request, smollm2_gguf_path) -> Iterator[LiveServer]:
    yield from live_server(make_async_engine(request.param))


@pytest.fixture(scope="module")
def fake_server() -> Iterator[LiveServer]:
    """A server over the fake engine alone, for tests that inject engine failures."""
    yield from live_server(make_async_engine("fake"))
