"""Fixtures for server tests: a live specserve HTTP server on a free loopback port.

Every server test runs twice: against the real engine serving SmolLM2-135M-Instruct (the default model,
fp32 on CPU) and against the deterministic fake in ``fake_engine.py`` (which can also inject failures).
``SPECSERVE_TEST_ENGINE_FACTORY=package.module:function`` swaps in another engine for the real one.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from specserve.server.api import build_app
from specserve.server.launch import start_server_in_thread
from specserve.server.metrics import ServingMetrics

from .fake_engine import FakeAsyncEngine

MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024


def make_real_async_engine() -> Any:
    """The real engine over the default model, sized for CPU tests."""
    from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.engine import LLMEngine

    cfg = EngineConfig(model="default", dtype="float32", device="cpu", cache=CacheConfig(num_blocks=512),
                       scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=16))
    engine = LLMEngine.from_config(cfg)
    from specserve.models.fetch import DEFAULT_MODEL_NAME as name
    return AsyncEngine(engine, ServingMetrics(name, max_model_len=engine.max_model_len), model_name=name)


def make_async_engine(kind: str) -> Any:
    """The engine the server tests run against (see the module docstring)."""
    if kind == "fake":
        return FakeAsyncEngine(model_name="fake-model", max_model_len=2048, metrics=ServingMetrics("fake-model"))
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


def _live_server(engine: Any) -> Iterator[LiveServer]:
    app = build_app(engine, engine.model_name, max_request_body_bytes=MAX_REQUEST_BODY_BYTES)
    base_url, stop = start_server_in_thread(app)
    try:
        yield LiveServer(base_url=base_url, engine=engine, model=engine.model_name)
    finally:
        stop()


@pytest.fixture(scope="module", params=["real", "fake"])
def server(request, smollm2_gguf_path) -> Iterator[LiveServer]:
    yield from _live_server(make_async_engine(request.param))


@pytest.fixture(scope="module")
def fake_server() -> Iterator[LiveServer]:
    """A server over the fake engine alone, for tests that inject engine failures."""
    yield from _live_server(make_async_engine("fake"))
