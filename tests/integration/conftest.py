"""Fixtures for server tests: a live specserve HTTP server on a free loopback port.

``make_async_engine()`` builds the engine under test. By default it is the deterministic fake in
``fake_engine.py``; set ``SPECSERVE_TEST_ENGINE_FACTORY=package.module:function`` to run the same tests
against a real ``AsyncEngine`` (the factory takes no arguments and returns an AsyncEngine whose
``metrics`` attribute is its ``ServingMetrics``).
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


def make_async_engine() -> Any:
    """The engine the server tests run against (see the module docstring)."""
    factory_path = os.environ.get("SPECSERVE_TEST_ENGINE_FACTORY")
    if factory_path:
        module_name, _, func_name = factory_path.partition(":")
        return getattr(importlib.import_module(module_name), func_name)()
    return FakeAsyncEngine(model_name="fake-model", max_model_len=2048, metrics=ServingMetrics("fake-model"))


@dataclass
class LiveServer:
    base_url: str
    engine: Any
    model: str

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engine = make_async_engine()
    app = build_app(engine, engine.model_name, max_request_body_bytes=MAX_REQUEST_BODY_BYTES)
    base_url, stop = start_server_in_thread(app)
    try:
        yield LiveServer(base_url=base_url, engine=engine, model=engine.model_name)
    finally:
        stop()
