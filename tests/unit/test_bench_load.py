"""The streaming client and the load patterns against an in-process fake OpenAI server (httpx.MockTransport):
SSE parsing and timing, every failure reported per request, closed-loop concurrency held exactly, Poisson
arrivals, and a stop that ends a level with its in-flight requests marked interrupted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
import numpy as np
import pytest

from specserve.bench.client import RequestResult, RequestSpec, send_request
from specserve.bench.datasets import BenchPrompt
from specserve.bench.load import INTERRUPTED, LevelPlan, LevelRunner, poisson_arrivals

PROMPT = BenchPrompt("test", 0, "hi", [{"role": "user", "content": "hi"}])
SPEC = RequestSpec(model="m", max_tokens=8)


def sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def chat_chunk(text: str | None = None, finish: str | None = None) -> dict:
    delta = {} if text is None else {"content": text}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


class FakeServer:
    """Streams ``pieces`` (one chunk each, ``delay_s`` apart), then a usage chunk and [DONE]."""

    def __init__(self, pieces: list[str], delay_s: float = 0.0, usage_tokens: int | None = None) -> None:
        self.pieces, self.delay_s = pieces, delay_s
        self.usage_tokens = len(pieces) if usage_tokens is None else usage_tokens
        self.in_flight = 0
        self.max_in_flight = 0
        self.started_at: list[float] = []
        self.bodies: list[dict] = []

    async def handler(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        self.started_at.append(asyncio.get_running_loop().time())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

        async def body() -> AsyncIterator[bytes]:
            counted = True
            try:
                yield sse(chat_chunk(""))  # role chunk without text, as specserve and vLLM send
                for piece in self.pieces:
                    await asyncio.sleep(self.delay_s)
                    yield sse(chat_chunk(piece))
                yield sse(chat_chunk(None, "length"))
                yield sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": self.usage_tokens,
                                                     "speculative": {"method": "ngram", "num_drafts": 1,
                                                                     "draft_tokens": 2, "accepted_tokens": 1}}})
                self.in_flight, counted = self.in_flight - 1, False  # the client stops reading at [DONE]
                yield b"data: [DONE]\n\n"
            finally:
                if counted:
                    self.in_flight -= 1

        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})


def client_for(handler: Callable) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def one_request(handler: Callable, timeout_s: float = 5.0, spec: RequestSpec = SPEC, **kw) -> RequestResult:
    async with client_for(handler) as client:
        return await send_request(client, "http://test", spec, PROMPT, RequestResult(0, 0), timeout_s=timeout_s,
                                  **kw)


def test_stream_is_timed_and_counted() -> None:
    server = FakeServer(["Hel", "lo", " world"], delay_s=0.01)
    r = asyncio.run(one_request(server.handler, count_tokens=lambda text: len(text.split()), save_text=True))
    assert r.ok and r.error is None and r.status_code == 200
    assert r.output_text == "Hello world" and r.output_chars == 11
    assert r.num_chunks == 3 and len(r.itl_s) == 2
    assert 0 < r.ttft_s == r.chunk_times_s[0] <= r.chunk_times_s[-1] <= r.e2e_s
    assert r.usage_completion_tokens == 3 and r.usage_prompt_tokens == 3 and r.output_tokens == 3
    assert r.stream_tokens == 2 and r.token_count_mismatch  # the counter sees 2 words, the server said 3
    assert r.finish_reason == "length" and r.speculative["accepted_tokens"] == 1
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 2)
    body = server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == PROMPT.messages and body["max_tokens"] == 8 and "ignore_eos" not in body


def test_completions_payload_and_extra_body() -> None:
    spec = RequestSpec(model="m", max_tokens=4, endpoint="completions", ignore_eos=True,
                       extra_body={"speculative": "off"})
    body = spec.payload(PROMPT)
    assert spec.path == "/v1/completions" and body["prompt"] == "hi" and "messages" not in body
    assert body["ignore_eos"] is True and body["speculative"] == "off"


@pytest.mark.parametrize("handler, expected", [
    (lambda req: httpx.Response(400, json={"error": {"message": "max_tokens: too big", "type": "invalid"}}),
     "HTTP 400: max_tokens: too big"),
    (lambda req: httpx.Response(200, content=sse(chat_chunk("a")) + sse({"error": {"message": "engine died"}})),
     "error in stream: engine died"),
    (lambda req: httpx.Response(200, content=sse(chat_chunk("a"))), "stream ended before data: [DONE]"),
    (lambda req: httpx.Response(200, content=b"data: {not json\n\n"), "bad response"),
])
def test_failures_are_reported_not_raised(handler: Callable, expected: str) -> None:
    r = asyncio.run(one_request(handler))
    assert not r.ok and r.error.startswith(expected)


def test_connection_refused_is_reported() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("All connection attempts failed") from ConnectionRefusedError(111,
                                                                                              "Connection refused")
    r = asyncio.run(one_request(refuse))
    assert not r.ok and r.error == "connection failed: [Errno 111] Connection refused"


def test_timeout_is_reported() -> None:
    r = asyncio.run(one_request(FakeServer(["a", "b"], delay_s=0.5).handler, timeout_s=0.2))
    assert not r.ok and r.error.startswith("timeout")
    assert r.e2e_s < 0.45


def run_level(server: FakeServer, plan: LevelPlan, num: int, stop: asyncio.Event | None = None,
              stop_after_s: float | None = None):
    async def go():
        event = stop or asyncio.Event()
        async with client_for(server.handler) as client:
            runner = LevelRunner(client, "http://test", SPEC, seed=3)
            if stop_after_s is not None:
                asyncio.get_running_loop().call_later(stop_after_s, event.set)
            return await runner.run([PROMPT] * num, plan, event)
    return asyncio.run(go())


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_closed_loop_holds_concurrency(concurrency: int) -> None:
    server = FakeServer(["x"] * 3, delay_s=0.01)
    level = run_level(server, LevelPlan(concurrency=concurrency, num_prompts=10), 10)
    assert not level.interrupted and len(level.results) == 10 and all(r.ok for r in level.results)
    assert server.max_in_flight == min(concurrency, 10)
    assert sorted(r.index for r in level.results) == list(range(10))
    assert all(r.scheduled_s == r.start_s for r in level.results)


def test_poisson_arrivals_are_seeded_with_the_right_rate() -> None:
    a = poisson_arrivals(20000, request_rate=4.0, seed=1)
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    assert np.mean(np.diff(a)) == pytest.approx(0.25, rel=0.03)
    assert np.array_equal(a, poisson_arrivals(20000, 4.0, seed=1))
    assert not np.array_equal(a, poisson_arrivals(20000, 4.0, seed=2))


def test_open_loop_sends_at_the_arrival_times() -> None:
    server = FakeServer(["x"], delay_s=0.0)
    level = run_level(server, LevelPlan(concurrency=None, num_prompts=6, request_rate=20.0), 6)
    assert all(r.ok for r in level.results)
    expected = poisson_arrivals(6, 20.0, seed=3)
    scheduled = sorted(r.scheduled_s for r in level.results)
    assert scheduled == pytest.approx(list(expected))
    sent = np.array(sorted(server.started_at)) - min(server.started_at)
    assert sent == pytest.approx(expected, abs=0.03)


def test_open_loop_cap_makes_arrivals_wait() -> None:
    server = FakeServer(["x"] * 5, delay_s=0.02)  # each request takes ~0.1 s
    level = run_level(server, LevelPlan(concurrency=1, num_prompts=4, request_rate=1000.0), 4)
    assert server.max_in_flight == 1
    assert max(r.start_s - r.scheduled_s for r in level.results) > 0.2


def test_stop_interrupts_the_level() -> None:
    server = FakeServer(["x"] * 50, delay_s=0.02)  # ~1 s per request
    level = run_level(server, LevelPlan(concurrency=2, num_prompts=10), 10, stop_after_s=0.3)
    assert level.interrupted
    assert len(level.results) == 2 and all(r.error == INTERRUPTED for r in level.results)
    assert level.duration_s < 0.8
