"""The synchronous engine: ``step()`` = schedule, run, sample, commit. One call advances every running
request by one token (or one prefill chunk)."""

from __future__ import annotations

import time
from typing import Protocol

import torch

from specserve.config import EngineConfig
from specserve.engine.block_manager import BlockManager
from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Request, RequestOutput
from specserve.engine.scheduler import Scheduler, SchedulerOutput
from specserve.engine.stats import RequestStats, StepStats
from specserve.layers.sampler import sample
from specserve.sampling import SamplingParams


class MetricsSink(Protocol):
    def record_step(self, stats: StepStats) -> None: ...
    def record_request(self, stats: RequestStats) -> None: ...


class LLMEngine:
    def __init__(self, config: EngineConfig, model, model_config, tokenizer, metrics: MetricsSink | None = None):
        self.config = config
        self.device = torch.device(config.device)
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.runner = ModelRunner(model, model_config, config.cache, self.device)
        block_size = config.cache.block_size
        max_len = config.scheduler.max_model_len or model_config.max_position_embeddings
        max_len = min(max_len, model_config.max_position_embeddings, model.max_position)
        # A request must fit in the cache on its own, or preemption could never make room for it.
        self.max_model_len = min(max_len, self.runner.num_blocks * block_size)
        if not config.scheduler.enable_chunked_prefill and config.scheduler.max_num_batched_tokens < self.max_model_len:
            raise ValueError("max_num_batched_tokens: must be >= max_model_len when chunked prefill is disabled")
        self.block_manager = BlockManager(self.runner.num_blocks, block_size)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids if tokenizer is not None else model_config.eos_token_ids)

    @classmethod
    def from_config(cls, config: EngineConfig, metrics: MetricsSink | None = None) -> LLMEngine:
        from specserve.models.loader import load_model
        model, model_config, tokenizer = load_model(config.model, config.dtype, torch.device(config.device),
                                                    config.scheduler.max_model_len, config.seed,
                                                    config.quantized_cpu_kernels)
        return cls(config, model, model_config, tokenizer, metrics)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if not prompt_ids:
            raise ValueError("prompt: must contain at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens leave no room to generate within the context "
                             f"limit of {self.max_model_len} tokens")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        detok = None
        if self.tokenizer is not None:
            from specserve.tokenizer import IncrementalDetokenizer
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        req = Request(request_id, list(prompt_ids), params, self.eos_token_ids, generator=gen, detokenizer=detok)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self.scheduler.finish(req, "abort")
        return self._finalize(req, [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.monotonic()
        for s in sched.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        self.runner.copy_blocks(self.block_manager.pending_copies)
        self.block_manager.pending_copies.clear()
        tables = [self.block_manager.block_table(s.request.request_id) for s in sched.scheduled]
        logits = self.runner.execute(sched, tables)
        sampling = [s for s in sched.scheduled if s.samples]
        tokens = sample(logits, [s.request.params for s in sampling],
                        [s.request.generator for s in sampling], self.generator)
        for s in sched.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        outputs = [self._commit(s.request, [tok]) for s, tok in zip(sampling, tokens)]
        self._record_step(sched, len(sampling))
        return outputs

    def _commit(self, req: Request, new_ids: list[int]) -> RequestOutput:
        """Append sampled tokens one by one, applying stop conditions after each."""
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        emitted: list[int] = []
        p = req.params
        for tok in new_ids:
            req.output_ids.append(tok)
            emitted.append(tok)
            if tok in p.stop_token_ids or (tok in req.eos_token_ids and not p.ignore_eos):
                reason = "stop"
            else:
                reason = self._append_text(req, tok)
            if reason is None and len(req.output_ids) >= p.max_tokens:
                reason = "length"
            if reason is None and req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                self.scheduler.finish(req, reason)
                break
        if req.finished:
            return self._finalize(req, emitted)
        return RequestOutput(req.request_id, emitted, self._take_text(req), False, None,
                             req.num_prompt_tokens, len(req.output_ids))

    def _append_text(self, req: Request, tok: int) -> str | None:
        if req.detokenizer is None:
            return None
        prev = len(req.output_text)
        req.output_text += req.detokenizer.step([tok])
        stops = req.params.stop
        if not stops:
            return None
        window = max(len(s) for s in stops)
        start = max(0, prev - window + 1)
        hits = [i for i in (req.output_text.find(s, start) for s in stops) if i >= 0]
        if hits:
            req.output_text = req.output_text[:min(hits)]
            req.detokenizer = None  # nothing after the stop string is ever shown
            return "stop"
        return None

    def _take_text(self, req: Request) -> str:
        """New text to stream; while running, hold back a tail that could still become a stop string."""
        end = len(req.output_text)
        if not req.finished and req.params.stop:
            end -= max(len(s) for s in req.params.stop) - 1
        if end <= req.num_text_emitted:
            return ""
        text = req.output_text[req.num_text_emitted:end]
        req.num_text_emitted = end
        return text

    def _finalize(self, req: Request, emitted: list[int]) -> RequestOutput:
        req.finished_time = time.monotonic()
        if req.detokenizer is not None and req.finish_reason != "abort":
            req.output_text += req.detokenizer.flush()  # bytes held back for an incomplete character
        del self.requests[req.request_id]
        if self.metrics is not None:
            self.metrics.record_request(self._request_stats(req))
        return RequestOutput(req.request_id, emitted, self._take_text(req), True, req.finish_reason,
                             req.num_prompt_tokens, len(req.output_ids))

    @staticmethod
    def _request_stats(req: Request) -> RequestStats:
        end = req.finished_time
        n_out = len(req.output_ids)
        tpot = None
        if req.first_token_time is not None and n_out >= 2:
            tpot = (end - req.first_token_time) / (n_out - 1)
        return RequestStats(
            finish_reason=req.finish_reason or "abort",
            num_prompt_tokens=req.num_prompt_tokens,
            num_generation_tokens=n_out,
            queue_time=((req.first_scheduled_time or end) - req.arrival_time),
            time_to_first_token=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            time_per_output_token=tpot,
            e2e_latency=end - req.arrival_time,
        )

    def record_idle(self) -> None:
        """Publish queue and cache gauges outside a step (after an abort, say)."""
        self._record_step(SchedulerOutput(), 0)

    def _record_step(self, sched: SchedulerOutput, num_sampled: int) -> None:
        if self.metrics is None:
            return
        prompt_tokens = sum(
            max(0, min(s.request.num_computed_tokens, s.request.num_prompt_tokens)
                - max(0, s.request.num_computed_tokens - s.num_new_tokens))
            for s in sched.scheduled)
        self.metrics.record_step(StepStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=self.block_manager.usage(),
            num_prompt_tokens=prompt_tokens,
            num_generation_tokens=num_sampled,
            num_preemptions=len(sched.preempted),
        ))

    # ---- offline convenience -------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Request]:
        """Run prompts to completion; returns the finished requests (output_ids, output_text) in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        reqs = []
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
            reqs.append(self.requests[rid])
        while any(not r.finished for r in reqs):
            self.step()
        return reqs
