"""A deterministic stand-in for ``AsyncEngine`` so the HTTP server can be tested without a model.

Same surface as ``specserve.engine.async_engine.AsyncEngine`` (tokenizer, model_name, max_model_len, start,
shutdown, resolve_spec, generate, abort, kv_cache_usage) plus a few hooks for tests: a fake paged-KV block counter
(``used_blocks``; ``kv_cache_usage()`` reads it), ``num_aborted``, a per-step delay so streams are slow
enough to disconnect from, and ``FAIL_MARKER``: a prompt containing it makes ``generate`` raise.

Tokenizer: bytes are tokens (ids 0..255), plus BOS 256 and EOS 257. Output: a slice of a fixed text picked
by the prompt, emitted 1..3 tokens per step (as speculative decoding would), ending with EOS after a
prompt-dependent length unless ``ignore_eos``; stop strings and ``max_tokens`` end it as the real engine does.

Speculation: off by default, "ngram" loaded (as on a real server started without ``--spec-method``). A request
that speculates emits at most ``1 + num_spec_tokens`` tokens a step and counts each step after the first as
one draft of ``num_spec_tokens`` tokens with all but one of its emitted tokens accepted.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from specserve.engine.stats import RequestStats, StepStats
from specserve.sampling import SamplingParams
from specserve.server.metrics import ServingMetrics
from specserve.spec.params import SPEC_OFF, SpecCounters, SpecParams

CORPUS = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
          "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. ")
FAIL_MARKER = "__fake_engine_fail__"


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    spec_method: str = "none"
    spec_counters: SpecCounters | None = None
    num_spec_tokens: int = 0


class FakeTokenizer:
    """Byte-level tokenizer with a ChatML-like template."""

    bos_token_id = 256
    eos_token_ids = [257]
    vocab_size = 258

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        parts = []
        for message in messages:
            if message["role"] == "tool":
                raise ValueError("the fake chat template has no tool role")
            parts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


class FakeAsyncEngine:
    def __init__(self, model_name: str = "fake-model", max_model_len: int = 2048,
                 metrics: ServingMetrics | None = None, step_delay_s: float = 0.002,
                 num_blocks: int = 4096, block_size: int = 16) -> None:
        self.tokenizer = FakeTokenizer()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.step_delay_s = step_delay_s
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.used_blocks = 0
        self.num_aborted = 0
        self._blocks: dict[str, int] = {}
        self._aborting: set[str] = set()
        self._started = False
        self.spec_methods = ("ngram",)
        self.default_num_spec_tokens = 3

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        asyncio.get_running_loop()  # like the real engine: must be called inside the event loop
        self._started = True

    async def shutdown(self) -> None:
        for request_id in list(self._blocks):
            self.abort(request_id)
        self._started = False

    def kv_cache_usage(self) -> float:
        return self.used_blocks / self.num_blocks

    def abort(self, request_id: str) -> None:
        if request_id in self._blocks:
            self._aborting.add(request_id)

    def resolve_spec(self, method: str | None = None, num_spec_tokens: int | None = None) -> SpecParams:
        """As ``LLMEngine.resolve_spec`` on a server whose default is off."""
        if method is None or method == "none":
            return SPEC_OFF
        if method not in self.spec_methods:
            raise ValueError(f"speculative.method: {method!r} is not loaded on this server")
        k = self.default_num_spec_tokens if num_spec_tokens is None else num_spec_tokens
        return SpecParams(method, k) if k > 0 else SPEC_OFF

    # -- generation ------------------------------------------------------------------------------------

    def _set_blocks(self, request_id: str, num_tokens: int) -> None:
        blocks = math.ceil(num_tokens / self.block_size)
        self.used_blocks += blocks - self._blocks.get(request_id, 0)
        self._blocks[request_id] = blocks

    def _record_step(self, num_prompt: int, num_generated: int, spec: SpecParams = SPEC_OFF,
                     drafts: SpecCounters | None = None) -> None:
        if self.metrics is None:
            return
        stats = StepStats(num_running=len(self._blocks), num_waiting=0, kv_cache_usage=self.kv_cache_usage(),
                          num_prompt_tokens=num_prompt, num_generation_tokens=num_generated, num_preemptions=0)
        if spec.enabled and num_generated:
            stats.spec_emitted_per_step[spec.method] = [num_generated]
            if drafts is not None:
                stats.spec[spec.method] = drafts
        self.metrics.record_step(stats)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       spec: SpecParams | None = None) -> AsyncIterator[RequestOutput]:
        if not self._started:
            raise RuntimeError("engine not started")
        if request_id in self._blocks:
            raise ValueError(f"duplicate request id {request_id}")
        if FAIL_MARKER in self.tokenizer.decode(prompt_ids):
            raise RuntimeError("fake engine failure")
        arrival = time.monotonic()
        seed = sum(prompt_ids)
        offset = seed % len(CORPUS)
        natural_len = 24 + seed % 17
        out_ids: list[int] = []
        emitted_chars = 0
        hold_back = max((len(s) for s in params.stop), default=1) - 1
        first_token_time: float | None = None
        finish_reason: str | None = None
        spec = SPEC_OFF if spec is None else spec
        counters = SpecCounters()
        self._set_blocks(request_id, len(prompt_ids))
        try:
            step = 0
            while finish_reason is None:
                await asyncio.sleep(self.step_delay_s)
                if request_id in self._aborting:
                    finish_reason = "abort"
                    yield RequestOutput(request_id, [], "", True, "abort", len(prompt_ids), len(out_ids),
                                        spec.method, counters, spec.num_spec_tokens if spec.enabled else 0)
                    return
                new_ids: list[int] = []
                max_new = 1 + min(step % 3, spec.num_spec_tokens) if spec.enabled else 1 + step % 3
                for _ in range(max_new):
                    if len(out_ids) + len(new_ids) >= params.max_tokens:
                        break
                    n = len(out_ids) + len(new_ids)
                    if n >= natural_len and not params.ignore_eos:
                        new_ids.append(self.tokenizer.eos_token_ids[0])
                        break
                    new_ids.append(ord(CORPUS[(offset + n) % len(CORPUS)]))
                out_ids.extend(new_ids)
                first_token_time = first_token_time or time.monotonic()
                self._set_blocks(request_id, len(prompt_ids) + len(out_ids))
                drafts = None
                if spec.enabled and step > 0:  # the first step prefills; later ones verify a draft
                    drafts = SpecCounters()
                    drafts.record(spec.num_spec_tokens, len(new_ids) - 1)
                    counters.record(spec.num_spec_tokens, len(new_ids) - 1)
                self._record_step(len(prompt_ids) if step == 0 else 0, len(new_ids), spec, drafts)
                step += 1

                text = self.tokenizer.decode(out_ids)
                stop_at = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
                if stop_at >= 0:
                    text, finish_reason = text[:stop_at], "stop"
                elif out_ids and out_ids[-1] in self.tokenizer.eos_token_ids:
                    finish_reason = "stop"
                elif len(out_ids) >= params.max_tokens:
                    finish_reason = "length"
                end = len(text) if finish_reason else max(emitted_chars, len(text) - hold_back)
                delta, emitted_chars = text[emitted_chars:end], end
                yield RequestOutput(request_id, new_ids, delta, finish_reason is not None, finish_reason,
                                    len(prompt_ids), len(out_ids), spec.method, counters,
                                    spec.num_spec_tokens if spec.enabled else 0)
        finally:
            if finish_reason in (None, "abort"):
                self.num_aborted += 1
            self.used_blocks -= self._blocks.pop(request_id, 0)
            self._aborting.discard(request_id)
            if self.metrics is not None:
                now = time.monotonic()
                self._record_step(0, 0)
                tpot = ((now - first_token_time) / (len(out_ids) - 1)
                        if first_token_time is not None and len(out_ids) > 1 else None)
                self.metrics.record_request(RequestStats(
                    finish_reason=finish_reason or "abort", num_prompt_tokens=len(prompt_ids),
                    num_generation_tokens=len(out_ids), queue_time=0.0,
                    time_to_first_token=None if first_token_time is None else first_token_time - arrival,
                    time_per_output_token=tpot, e2e_latency=now - arrival, spec_method=spec.method,
                    spec=counters))
