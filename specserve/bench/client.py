"""One streamed OpenAI-compatible request, timed chunk by chunk.

The request asks for ``stream_options.include_usage`` so the server's own token counts arrive on the last
chunk. Every failure (connection refused, HTTP error status, an error object inside the stream, a stream cut
short, a timeout) becomes a ``RequestResult`` with ``ok=False`` and a message; nothing here raises.

Times are seconds from the moment the request was sent: ``ttft_s`` to the first chunk with output text,
``chunk_times_s`` for every chunk with output text (one chunk may carry several tokens when the server
speculates), ``e2e_s`` to the end of the stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from specserve.bench.datasets import BenchPrompt

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass
class RequestSpec:
    """What every request of a run sends, besides its prompt."""

    model: str
    max_tokens: int
    temperature: float = 0.0
    endpoint: str = "chat"  # "chat" or "completions"
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    def payload(self, prompt: BenchPrompt) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens,
                                "temperature": self.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = prompt.messages
        else:
            body["prompt"] = prompt.text
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body

    @property
    def path(self) -> str:
        return CHAT_PATH if self.endpoint == "chat" else COMPLETIONS_PATH


@dataclass
class RequestResult:
    """Every raw number of one request (kept as-is in report.json)."""

    index: int  # order in which the level issued it
    dataset_row: int
    ok: bool = False
    error: str | None = None
    status_code: int | None = None
    scheduled_s: float = 0.0  # when it was due, seconds from the start of the level (open loop: its arrival)
    start_s: float = 0.0  # when it was sent, seconds from the start of the level
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    output_chars: int = 0
    stream_tokens: int | None = None  # the streamed text re-tokenized (None without a tokenizer)
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    finish_reason: str | None = None
    speculative: dict[str, Any] | None = None  # usage.speculative as the server sent it
    output_text: str | None = None  # kept only with --save-text

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_times_s)

    @property
    def output_tokens(self) -> int:
        """Output length: the server's usage when it sent one, else the re-tokenized stream, else chunks."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        if self.stream_tokens is not None:
            return self.stream_tokens
        return self.num_chunks

    @property
    def token_count_mismatch(self) -> bool:
        """The stream re-tokenized disagrees with the server's usage (both known). A response that ended with
        finish_reason "stop" may count its end token (EOS) in usage without streaming it: one fewer agrees."""
        if not self.ok or self.stream_tokens is None or self.usage_completion_tokens is None:
            return False
        unstreamed_end = 1 if self.finish_reason == "stop" else 0
        return self.stream_tokens not in (self.usage_completion_tokens, self.usage_completion_tokens - unstreamed_end)

    @property
    def itl_s(self) -> list[float]:
        """Inter-chunk latencies: gaps between consecutive chunks that carried text."""
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output tokens - 1)."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; times rounded to the microsecond (a perf_counter reading is not finer anyway)."""
        d = asdict(self)
        d["chunk_times_s"] = [round(t, 6) for t in self.chunk_times_s]
        for key in ("scheduled_s", "start_s", "ttft_s", "e2e_s"):
            if d[key] is not None:
                d[key] = round(d[key], 6)
        d.update(num_chunks=self.num_chunks, output_tokens=self.output_tokens, tpot_s=self.tpot_s,
                 token_count_mismatch=self.token_count_mismatch)
        if d["output_text"] is None:
            del d["output_text"]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestResult:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


TokenCounter = Callable[[str], int]


async def send_request(client: httpx.AsyncClient, base_url: str, spec: RequestSpec, prompt: BenchPrompt,
                       result: RequestResult, *, timeout_s: float,
                       count_tokens: TokenCounter | None = None, save_text: bool = False) -> RequestResult:
    """Send one streamed request and fill ``result`` in; never raises (except on cancellation)."""
    t0 = time.perf_counter()
    parts: list[str] = []
    try:
        await asyncio.wait_for(_stream(client, base_url.rstrip("/") + spec.path, spec, prompt, result, parts, t0),
                               timeout=timeout_s)
    except asyncio.TimeoutError:
        result.error = f"timeout: no complete response within {timeout_s:g} s"
    except httpx.ConnectError as exc:
        result.error = f"connection failed: {_os_reason(exc)}"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    except (ValueError, KeyError, TypeError) as exc:  # a malformed chunk
        result.error = f"bad response: {type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - t0
    text = "".join(parts)
    result.output_chars = len(text)
    if save_text:
        result.output_text = text
    if count_tokens is not None and result.error is None:
        result.stream_tokens = count_tokens(text)
    result.ok = result.error is None
    return result


async def _stream(client: httpx.AsyncClient, url: str, spec: RequestSpec, prompt: BenchPrompt,
                  result: RequestResult, parts: list[str], t0: float) -> None:
    async with client.stream("POST", url, json=spec.payload(prompt)) as resp:
        result.status_code = resp.status_code
        if resp.status_code != 200:
            body = (await resp.aread()).decode("utf-8", "replace")
            result.error = f"HTTP {resp.status_code}: {_error_message(body)}"
            return
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                result.error = f"error in stream: {_error_message(data)}"
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
                result.usage_prompt_tokens = usage.get("prompt_tokens")
                result.usage_completion_tokens = usage.get("completion_tokens")
                result.speculative = usage.get("speculative")
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if spec.endpoint == "chat" else choice.get("text")
                if text:
                    now = time.perf_counter() - t0
                    if result.ttft_s is None:
                        result.ttft_s = now
                    result.chunk_times_s.append(now)
                    parts.append(text)
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
        if not done:
            result.error = "stream ended before data: [DONE]"


def _os_reason(exc: BaseException) -> str:
    """The OS-level reason under an httpx error (e.g. "[Errno 111] Connection refused"), else its message."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return f"[Errno {seen.errno}] {seen.strerror}"
        seen = seen.__cause__ or seen.__context__
    return str(exc) or type(exc).__name__


def _error_message(body: str) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the body itself (truncated)."""
    try:
        obj = json.loads(body)
        err = obj.get("error", obj)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        if isinstance(obj.get("detail"), str):
            return obj["detail"][:500]
    except (ValueError, AttributeError):
        pass
    return body[:500]
