"""The server's engine loop dying of an error outside an engine step (``engine/async_engine.py``): the request in
flight gets an error response instead of hanging, ``/health`` turns 503 so that an orchestrator restarts the
server, and later requests get a 503 at once. The real ``AsyncEngine`` over a stub ``LLMEngine`` whose
``add_request`` raises (an error the loop does not expect: not the ``ValueError`` of a rejected request)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from specserve.engine.async_engine import AsyncEngine
from specserve.spec.params import SPEC_OFF

from .conftest import LiveServer, live_server, wait_until
from .fake_engine import FakeTokenizer


class _BrokenEngine:
    """Just enough of ``LLMEngine`` for ``AsyncEngine``; taking in a request breaks it."""

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.model_config = SimpleNamespace(name="stub-model")
        self.max_model_len = 512
        self.metrics = None
        self.requests: dict = {}
        self.block_manager = SimpleNamespace(usage=lambda: 0.0)
        self.aborted: list[str] = []

    def resolve_spec(self, method=None, num_spec_tokens=None):
        return SPEC_OFF

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id, prompt_ids, params, spec=None) -> None:
        self.requests[request_id] = prompt_ids
        raise RuntimeError("scheduler bookkeeping broke")

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        return self.requests.pop(request_id, None)


@pytest.fixture()
def broken() -> Iterator[LiveServer]:
    yield from live_server(AsyncEngine(_BrokenEngine()))


@pytest.mark.parametrize("stream", [False, True])
def test_a_dead_engine_loop_answers_fails_fast_and_reports_unhealthy(broken: LiveServer, stream: bool) -> None:
    assert httpx.get(f"{broken.base_url}/health").status_code == 200
    body = {"model": broken.model, "prompt": "Hello", "max_tokens": 4, "stream": stream}
    first = httpx.post(f"{broken.api_url}/completions", json=body, timeout=30)
    if stream:  # the headers went out before the error: it arrives in the stream, which still ends
        assert first.status_code == 200 and '"error"' in first.text and first.text.rstrip().endswith("[DONE]")
    else:
        assert first.status_code == 500 and "engine loop has died" in first.json()["error"]["message"]
    assert "RuntimeError: scheduler bookkeeping broke" in first.text
    health = httpx.get(f"{broken.base_url}/health")
    assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable"
    assert broken.engine.engine.aborted and not broken.engine.engine.requests  # released as far as it could
    for later_stream in (False, True):  # refused before any response starts, streamed or not: a 503 to retry
        later = httpx.post(f"{broken.api_url}/completions", json={**body, "stream": later_stream}, timeout=30)
        assert later.status_code == 503 and later.json()["error"]["type"] == "service_unavailable"
    assert wait_until(lambda: not broken.engine._streams)
    assert broken.engine._commands.empty()  # nothing left queued for a loop that will never read it
