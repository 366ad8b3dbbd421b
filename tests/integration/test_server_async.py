"""The server over the real engine with asynchronous decode steps (``--async-scheduling``, the CUDA default; off
on CPU, so forced on here): concurrent streamed and non-streamed requests get the text the synchronous engine
gives, and a client that disconnects mid-stream, while a step for its request is already launched, has its
request aborted and its KV blocks freed."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from .conftest import LiveServer, concurrent_chat, live_server, make_real_async_engine, metric_value, wait_until


@pytest.fixture(scope="module")
def servers(smollm2_gguf_path) -> Iterator[dict[str, LiveServer]]:
    async_gen = live_server(make_real_async_engine(async_scheduling=True))
    sync_gen = live_server(make_real_async_engine(async_scheduling=False))
    try:
        yield {"async": next(async_gen), "sync": next(sync_gen)}
    finally:
        for gen in (async_gen, sync_gen):
            gen.close()


def _answers(server: LiveServer) -> list[tuple[str, str | None]]:
    return concurrent_chat(server, [dict(messages=[{"role": "user", "content": f"Request number {i}: name {i + 2} "
                                                    "animals."}], max_tokens=12 + 5 * i, temperature=0)
                                    for i in range(8)])


def test_concurrent_requests_get_the_synchronous_engines_text(servers) -> None:
    got, want = _answers(servers["async"]), _answers(servers["sync"])
    assert got == want and all(text for text, _ in got)
    assert servers["async"].engine.engine.async_scheduling and not servers["sync"].engine.engine.async_scheduling
    for server in servers.values():
        assert wait_until(lambda s=server: s.engine.kv_cache_usage() == 0.0)


def test_disconnect_mid_stream_frees_blocks(servers) -> None:
    server = servers["async"]
    assert wait_until(lambda: server.engine.kv_cache_usage() == 0.0)
    aborted_before = metric_value(server, "specserve_request_success_total", finished_reason="abort")
    body = {"model": server.model, "prompt": "Once upon a time", "temperature": 0, "stream": True,
            "ignore_eos": True, "max_tokens": 400}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.api_url}/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert any(next(lines).startswith("data: {") for _ in range(6))
            assert server.engine.kv_cache_usage() > 0.0
    assert wait_until(lambda: server.engine.kv_cache_usage() == 0.0), "disconnect did not free KV blocks"
    assert wait_until(lambda: metric_value(server, "specserve_request_success_total",
                                           finished_reason="abort") >= aborted_before + 1)
    assert wait_until(lambda: server.engine.engine._in_flight is None)  # the loop drained the launched step
