"""The synchronous engine: ``step()`` = schedule, run, verify, commit, draft. One call advances every running
request by one prefill chunk, or by 1 to ``1 + num_spec_tokens`` tokens when it decodes.

Asynchronous decode steps (``SchedulerConfig.async_scheduling``, on by default on CUDA). A decode step waits for
its tokens only to commit them, and the next step needs them only as input ids, which can stay on the device.
So when a step is a plain decode (every request decoding one token, none speculating, or all held at draft cap 0
by the adaptive policy, spec/policy.py, whose drafters then catch up in a later synchronous step) and the next
one is certain to be the same requests decoding again (no waiting request the scheduler could admit, no request
at its length limit, KV blocks for all), ``step()`` schedules and launches the next step first and commits the
previous one while the GPU runs it: the host's schedule / prepare / commit time hides behind the device's
work. Each call then returns the outputs of the step before the one it launched (the first call of a run of
decode steps returns none):

    call k:   schedule N+1 (pending tokens of N counted) -> launch N+1 (ids = N's samples, on the device)
              -> wait for N's tokens -> commit N (stop conditions, text) -> return N's outputs

A request that finishes when N commits (EOS, a stop string, an abort) still has a row in N+1: its result is
dropped, and its KV blocks, freed at once, are reused only by later steps (stream order). Any other step
(prefill chunks, speculation, a new arrival, a full cache) runs synchronously after the pending step commits.

Speculative decoding is part of every step, not a separate loop: a decoding request carries the drafts its
proposer made at the end of the previous step; the scheduler gives it ``1 + num_drafts`` query tokens; the
target scores them all in the same ragged forward as everyone else's prefill chunks and decode tokens; the
verifier (``spec/verify.py``) keeps the accepted prefix plus one recovered or bonus token; KV of rejected
drafts is rolled back; the kept tokens are committed one by one through the stop conditions; then each
proposer sees what was verified and drafts for the next step. A plain decode step is the ``num_drafts == 0``
case of the same path."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.config import MAX_NUM_SPEC_TOKENS, EngineConfig
from specserve.engine.block_manager import BlockManager
from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Request, RequestOutput
from specserve.engine.scheduler import Scheduler, SchedulerOutput
from specserve.engine.stats import RequestStats, StepStats
from specserve.layers.sampler import TokenUniforms, sample_on_device
from specserve.sampling import SamplingParams
from specserve.spec.draft_graphs import INGEST_MAX_ENTRIES
from specserve.spec.params import SPEC_OFF, SpecCounters, SpecParams
from specserve.spec.policy import SpecPolicy
from specserve.spec.proposer import Proposer, VerifiedChunk
from specserve.spec.verify import verify


class MetricsSink(Protocol):
    def record_step(self, stats: StepStats) -> None: ...
    def record_request(self, stats: RequestStats) -> None: ...


logger = logging.getLogger(__name__)


@dataclass
class InFlightStep:
    """A launched decode step whose tokens have not been read back (asynchronous decode steps)."""

    sched: SchedulerOutput
    token_ids: torch.Tensor  # [num_scheduled] int64 on the device, one sampled token per request, scheduled order
    # [num_scheduled] int64 host copy, filled by a copy queued right after the sampling, so that reading it waits
    # for this step only, not for the step launched after it on the same stream
    host_token_ids: torch.Tensor
    copied: torch.cuda.Event | None  # recorded after that copy (None off CUDA, where the copy is synchronous)
    num_prompt_tokens: int  # prompt tokens this step computed (a last prompt chunk of one token), for metrics


# At draft cap 0, drafters skip at most this many steps in a row before catching up on the tokens verified since,
# unless every drafter says it may skip more (``lazy_steps``: an EAGLE-3 drafter with catch-up graphs of several
# passes): with the synchronous step's own token, a queue that an EAGLE ingest graph takes in one replay (at 16
# steps the 17-entry catch-up ran eagerly).
LAZY_DRAFT_STEPS = INGEST_MAX_ENTRIES - 1


def spec_caps(num_spec_tokens: int) -> tuple[int, ...]:
    """The adaptive policy's caps besides "no cap": 0, 1 and K // 2, those below K (a cap >= K is no cap).

        K = 1 -> (0,)    K = 3 -> (0, 1)    K = 5 -> (0, 1, 2)    K = 7 -> (0, 1, 3)
    """
    return tuple(sorted(c for c in {0, 1, num_spec_tokens // 2} if c < num_spec_tokens))


class LLMEngine:
    def __init__(self, config: EngineConfig, model, model_config, tokenizer, metrics: MetricsSink | None = None,
                 proposers: dict[str, Proposer] | None = None):
        self.config = config
        self.device = torch.device(config.device)
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.cublaslt_layers = 0  # projections given a measured cuBLASLt configuration (layers/cublaslt_gemm.py)
        if config.cublaslt_algos and self.device.type == "cuda":
            from specserve.layers import cublaslt_gemm, quant_tiles
            self.cublaslt_layers = cublaslt_gemm.attach(model, quant_tiles.BF16_LT_ALGOS, self.device)
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
        self.rng = TokenUniforms(config.seed)  # draws of sampled rows without a stream (none the engine makes)
        # seeds of unseeded sampled requests' streams, drawn on the host in arrival order (reproducible from
        # config.seed; independent of batch composition, which asynchronous decode steps change)
        self._request_seeds = random.Random(config.seed)
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids if tokenizer is not None else model_config.eos_token_ids)
        if proposers is None:
            from specserve.spec.factory import build_proposers
            proposers = build_proposers(config, model, model_config, self.runner.num_blocks, self.device)
        self.proposers = proposers
        self.aux_layer_ids = tuple(sorted({i for p in proposers.values() for i in p.aux_layer_ids}))
        spec = config.speculative
        self.default_spec = SpecParams(spec.method, spec.num_spec_tokens) if spec.method != "none" else SPEC_OFF
        self.default_num_spec_tokens = spec.num_spec_tokens
        # Adaptive speculation (spec/policy.py): a cap on the drafts per request, chosen each step from measured
        # goodput per batch size; ``_spec_cap`` is the cap the drafts now waiting for verification were made under.
        self.spec_policy = SpecPolicy(caps=spec_caps(spec.num_spec_tokens)) if spec.adaptive else None
        self._spec_cap: int | None = None
        self._spec_decided = False  # whether the last step's drafting asked the policy (someone could draft)
        self._lazy_draft_steps = 0  # steps in a row whose drafter work was left for later (cap 0)
        self._draft_seconds = 0.0  # how long the last step's drafting took
        self._caught_up = False  # whether it caught the drafters up after cap-0 steps
        self._draft_captured = False  # whether the last step's drafting captured a CUDA graph
        self._draft_after_prompt = False  # whether the last step's drafting also took in prompt chunks
        # the cap the policy chose for the next synchronous step's drafts while a run of cap-0 overlapped steps
        # ended (_cap_zero_continues), as a 1-tuple (None: no such decision pending)
        self._cap_ahead: tuple[int | None] | None = None
        self._async_commit_time: float | None = None  # when the last overlapped step committed (same run)
        # CUDA graphs (GPU only): capture decode and every verify length up to the server's num_spec_tokens at
        # startup: fewer drafts are verified near max_tokens and under the adaptive policy's caps, and a graph
        # captured on first use stalls that step (0.4 s for SmolLM2 on the H200, stop 27's step_trace_gpu.py).
        startup_query_lens = tuple(range(1, 2 + spec.num_spec_tokens)) if spec.method != "none" else (1,)
        self.runner.setup_cuda_graphs(config.cuda_graphs, self.max_model_len, config.scheduler.max_num_seqs,
                                      self.aux_layer_ids, startup_query_lens)
        self._setup_draft_graphs(config, model)
        async_scheduling = config.scheduler.async_scheduling
        self.async_scheduling = self.device.type == "cuda" if async_scheduling is None else async_scheduling
        self._in_flight: InFlightStep | None = None

    def set_spec_policy(self, policy: SpecPolicy | None) -> None:
        """Swap the adaptive speculation policy (None: off); the next drafting step asks the new one afresh."""
        self.spec_policy = policy
        self._spec_cap, self._spec_decided, self._cap_ahead = None, False, None

    def _setup_draft_graphs(self, config: EngineConfig, model) -> None:
        """With ``cuda_graphs.draft_steps`` and the target's graphs running: an EAGLE-3 head's drafting (ingest and
        draft steps, or steps 2..k alone after a long queue) replays graphs too, captured on first use into the
        target graphs' memory pool (``spec/draft_graphs.py``)."""
        graphs = self.runner.graphs
        proposer = self.proposers.get("eagle3")
        if graphs is None or not graphs.capture or not config.cuda_graphs.draft_steps or proposer is None:
            return
        if not hasattr(proposer, "use_chain_graphs") or not getattr(proposer.kv.backend, "capturable", False):
            return
        proposer.use_chain_graphs(config.cuda_graphs.batch_sizes, config.scheduler.max_num_seqs,
                                  MAX_NUM_SPEC_TOKENS - 1, model.max_position + MAX_NUM_SPEC_TOKENS, capture=True,
                                  pool=graphs.pool)

    @classmethod
    def from_config(cls, config: EngineConfig, metrics: MetricsSink | None = None) -> LLMEngine:
        from specserve.models.loader import load_model
        model, model_config, tokenizer = load_model(config.model, config.dtype, torch.device(config.device),
                                                    config.scheduler.max_model_len, config.seed,
                                                    config.quantized_cpu_kernels, config.quantization,
                                                    config.cpu_activation_quant, config.quantize_lm_head)
        return cls(config, model, model_config, tokenizer, metrics)

    # ---- requests ------------------------------------------------------------------------------
    def resolve_spec(self, method: str | None = None, num_spec_tokens: int | None = None) -> SpecParams:
        """A request's speculation from its override: ``method`` "none" turns it off; a missing method keeps
        the server's; a missing ``num_spec_tokens`` takes the server's. Raises ValueError naming the field."""
        if method is None and num_spec_tokens is None:
            return self.default_spec
        method = self.default_spec.method if method is None else method
        if method == "none":
            return SPEC_OFF
        if method not in self.proposers:
            loaded = ", ".join(sorted(self.proposers)) or "none"
            raise ValueError(f"speculative.method: {method!r} is not loaded on this server (available: {loaded})")
        k = self.default_num_spec_tokens if num_spec_tokens is None else num_spec_tokens
        return SpecParams(method, k) if k > 0 else SPEC_OFF

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    spec: SpecParams | None = None) -> None:
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
        rng = None
        if params.seed is not None:
            rng = TokenUniforms(params.seed)
        elif not params.greedy:  # its own stream, so its draws do not depend on who shares its steps
            rng = TokenUniforms(self._request_seeds.getrandbits(63))
        detok = None
        if self.tokenizer is not None:
            from specserve.tokenizer import IncrementalDetokenizer
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        spec = self.default_spec if spec is None else spec
        if spec.enabled and spec.method not in self.proposers:
            raise ValueError(f"speculative.method: {spec.method!r} is not loaded on this server")
        req = Request(request_id, list(prompt_ids), params, self.eos_token_ids, rng=rng, detokenizer=detok,
                      spec=spec)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self.scheduler.finish(req, "abort")
        return self._finalize(req, [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._in_flight is not None:  # an asynchronous decode step is running
            previous, self._in_flight = self._in_flight, None
            if self._next_decode_is_certain(previous) and self._cap_zero_continues():
                self._in_flight = self._try_launch_decode(self.scheduler.schedule(), previous.token_ids)
            return self._commit_decode(previous)
        started, captured = time.perf_counter(), self._capture_seconds()
        self._async_commit_time = None  # a synchronous step ends any run of overlapped steps
        cap, decided, drafting = self._spec_cap, self._spec_decided, self._draft_seconds
        # not this cap's cost: drafting that caught up on earlier cap-0 steps, that took in prompt chunks (an EAGLE
        # head's prefill over a new request's prompt), or that captured a graph
        decided = decided and not self._caught_up and not self._draft_captured and not self._draft_after_prompt
        sched = self.scheduler.schedule()
        for req in sched.preempted:
            self._free_spec_state(req)
        if sched.is_empty:
            return []
        if self.async_scheduling and self._is_plain_decode(sched):
            self._in_flight = self._launch_decode(sched, None)
            return []
        tables = self._prepare(sched)
        out = self.runner.execute(sched, tables, self.aux_layer_ids)
        sampling = [s for s in sched.scheduled if s.samples]
        drafts = [s.request.spec_token_ids[:s.num_spec_tokens] for s in sampling]
        draft_probs = [None if s.request.spec_draft_probs is None else s.request.spec_draft_probs[:s.num_spec_tokens]
                       for s in sampling]
        emitted = verify(out.logits, out.logit_starts, drafts, draft_probs, [s.request.params for s in sampling],
                         [s.request.rng for s in sampling], self.rng)
        emitted_by_req = {s.request.request_id: toks for s, toks in zip(sampling, emitted)}

        # Keep the KV of the last token and the accepted drafts; roll the rejected drafts' slots back.
        chunks: list[VerifiedChunk] = []
        step_spec: dict[str, SpecCounters] = {}
        emitted_per_step: dict[str, list[int]] = {}
        outcomes: list[tuple[int, int]] = []  # (drafts verified, accepted) per request that verified drafts
        for s, token_start in zip(sched.scheduled, out.token_starts):
            req = s.request
            num_rejected = 0
            if s.num_spec_tokens:
                num_accepted = len(emitted_by_req[req.request_id]) - 1
                num_rejected = s.num_spec_tokens - num_accepted
                if num_rejected:
                    self.block_manager.rollback(req.request_id, num_rejected)
                req.spec_counters.record(s.num_spec_tokens, num_accepted)
                outcomes.append((s.num_spec_tokens, num_accepted))
                step_spec.setdefault(req.spec.method, SpecCounters()).record(s.num_spec_tokens, num_accepted)
            chunks.append(VerifiedChunk(req, req.num_computed_tokens, token_start, s.num_new_tokens - num_rejected))
            req.num_computed_tokens += s.num_new_tokens - num_rejected
            req.spec_token_ids = []
            req.spec_draft_probs = None
        outputs = [self._commit(s.request, emitted_by_req[s.request.request_id]) for s in sampling]
        for s, o in zip(sampling, outputs):
            if s.num_spec_tokens:  # tokens a verified draft let this request commit (after stop conditions)
                emitted_per_step.setdefault(s.request.spec.method, []).append(len(o.new_token_ids))
        verified, verified_captured = time.perf_counter(), self._capture_seconds()
        decided = decided and verified_captured == captured  # not if a graph was captured for this step's forward
        self._draft(chunks, out.aux_hidden)
        self._draft_seconds = time.perf_counter() - verified
        self._draft_captured = self._capture_seconds() != verified_captured
        self._draft_after_prompt = not all(s.samples and s.num_new_tokens == 1 + s.num_spec_tokens
                                           for s in sched.scheduled)  # a prompt chunk was scheduled
        num_emitted = sum(len(o.new_token_ids) for o in outputs)
        if self.spec_policy is not None:
            if decided and self._is_speculative_decode(sched):
                # this step's work on the drafts it verified, plus the drafting that made them (the last step's)
                self.spec_policy.record(len(sched.scheduled), cap, verified - started + drafting, num_emitted,
                                        outcomes)
            elif outcomes:  # not this cap's cost alone, but the acceptance is what it is
                self.spec_policy.observe(outcomes)
        self._record_step(sched, num_emitted, step_spec, emitted_per_step)
        return outputs

    def _capture_seconds(self) -> float:
        """Time spent capturing CUDA graphs so far, target's and drafters' (graphs are captured on first use of a
        shape): a step during which it grew paid once for a capture, which the adaptive policy must not take for
        the cost of its cap (one such step among few probes held a policy at cap 0 on the H200)."""
        graphs = self.runner.graphs
        total = graphs.capture_seconds if graphs is not None else 0.0
        for proposer in self.proposers.values():
            chain = getattr(proposer, "chain", None)  # EAGLE drafting graphs (spec/draft_graphs.py)
            total += chain.capture_seconds if chain is not None else 0.0
        return total

    @staticmethod
    def _is_speculative_decode(sched: SchedulerOutput) -> bool:
        """Every scheduled request decoding (its last token plus its drafts, no prompt chunk) and at least one
        of them speculating: the steps whose goodput the adaptive policy compares."""
        return any(s.request.spec.enabled for s in sched.scheduled) and all(
            s.samples and s.num_new_tokens == 1 + s.num_spec_tokens for s in sched.scheduled)

    def _prepare(self, sched: SchedulerOutput) -> list[list[int]]:
        """Timestamps, pending copy-on-write block copies; returns the scheduled requests' block tables."""
        now = time.monotonic()
        for s in sched.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        self.runner.copy_blocks(self.block_manager.pending_copies)
        self.block_manager.pending_copies.clear()
        return [self.block_manager.block_table(s.request.request_id) for s in sched.scheduled]

    # ---- asynchronous decode steps (module docstring) ----------------------------------------------
    def _is_plain_decode(self, sched: SchedulerOutput) -> bool:
        """Every scheduled request decodes one token without drafts, and nobody was preempted. A speculating
        request qualifies only while the adaptive policy's cap is 0 (``_lazy_decode_ok``): its drafter is shown
        the step's features at launch and drafts nothing until a later synchronous step catches it up."""
        lazy_ok = self._lazy_decode_ok()
        return not sched.preempted and all(
            s.num_new_tokens == 1 and s.num_spec_tokens == 0 and s.samples and (lazy_ok or not s.request.spec.enabled)
            for s in sched.scheduled)

    def _lazy_decode_ok(self) -> bool:
        """The policy's cap is 0, it has not chosen another for the next step, and the drafters may wait one more
        step before catching up."""
        return (self.spec_policy is not None and self._spec_decided and self._spec_cap == 0
                and self._cap_ahead is None and self._lazy_draft_steps < self._lazy_limit())

    def _lazy_limit(self) -> int:
        """Steps in a row the drafters may sit out at cap 0: the fewest any of them allows at this batch size
        (``lazy_steps``), LAZY_DRAFT_STEPS for drafters that do not say. Stop 30: an EAGLE-3 drafter with catch-up
        graphs allows 63 at batch 8 (buckets up to 64), so it catches up a quarter as often as at 15."""
        limits = [f(self.num_running) for p in self.proposers.values()
                  if (f := getattr(p, "lazy_steps", None)) is not None]
        return min(limits, default=LAZY_DRAFT_STEPS)

    def _cap_zero_continues(self) -> bool:
        """Before another overlapped step of speculating requests held at cap 0 is launched, the policy decides
        that step's cap too, so that every step is one decision: a probe of cap 0 lasts ``probe_steps`` steps,
        not that many runs of up to LAZY_DRAFT_STEPS steps (stop 27 on the H200: probes of cap 0 took 32 steps
        each, 40% of a run the policy had judged better off speculating). Any other cap ends the run: the next
        synchronous step catches the drafters up and drafts under it (``_cap_ahead``)."""
        if self.spec_policy is None or not any(r.spec.enabled for r in self.scheduler.running):
            return True
        cap = self.spec_policy.choose(self.num_running)
        if cap == 0:
            return True
        self._cap_ahead = (cap,)
        return False

    def _next_decode_is_certain(self, previous: InFlightStep) -> bool:
        """Whether the next ``schedule()`` will give exactly ``previous``'s requests, in the same order, one
        token each, without preempting anyone, whatever tokens ``previous`` sampled (its tokens are pending)."""
        if not self.async_scheduling:
            return False
        running = self.scheduler.running
        budget = self.config.scheduler.max_num_batched_tokens
        if self.scheduler.waiting and len(running) < min(self.config.scheduler.max_num_seqs, budget):
            return False  # the scheduler would try to admit (a full server keeps overlapping while others queue)
        scheduled = previous.sched.scheduled
        if len(running) != len(scheduled) or any(r is not s.request for r, s in zip(running, scheduled)):
            return False  # a request finished, was aborted or joined since
        if len(running) > budget:
            return False
        if any(r.spec.enabled for r in running) and not self._lazy_decode_ok():
            return False  # their drafters must catch up (or the cap has changed): a synchronous step
        for r in running:
            # the step after previous samples token number len(output_ids) + num_pending_tokens + 1
            if len(r.output_ids) + r.num_pending_tokens >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
                return False
        bm = self.block_manager  # one more slot each, all at once (so no preemption)
        return sum(bm.blocks_needed(r.request_id, 1) for r in running) <= bm.num_free_blocks

    def _try_launch_decode(self, sched: SchedulerOutput, input_ids_device: torch.Tensor) -> InFlightStep | None:
        """``_launch_decode`` of a step scheduled while another is in flight; if it fails, the slots its schedule
        took are rolled back and None returned: the in-flight step still commits and returns its outputs, and the
        next step runs synchronously (where a lasting error raises as usual)."""
        try:
            return self._launch_decode(sched, input_ids_device)
        except Exception:  # noqa: BLE001 - logged; the synchronous step that follows surfaces a lasting failure
            logger.exception("asynchronous decode step failed to launch; continuing synchronously")
            for s in sched.scheduled:
                self.block_manager.rollback(s.request.request_id, s.num_new_tokens)
            return None

    def _launch_decode(self, sched: SchedulerOutput, input_ids_device: torch.Tensor | None) -> InFlightStep:
        """Run a plain decode step up to its sampled tokens, on the device, without waiting for them; its requests
        count the tokens as pending. ``input_ids_device``: the previous in-flight step's samples (same order)."""
        assert self._is_plain_decode(sched), "an asynchronous step must be a plain decode step"
        self._draft_seconds = 0.0  # nobody drafts for it: the synchronous step after a run verifies no drafts
        tables = self._prepare(sched)
        out = self.runner.execute(sched, tables, self.aux_layer_ids, input_ids_device)
        requests = [s.request for s in sched.scheduled]
        token_ids = sample_on_device(out.logits, [r.params for r in requests], [r.rng for r in requests],
                                     self.rng, consume=False)  # [num_scheduled]; streams advanced below
        host, copied = token_ids, None
        if token_ids.device.type == "cuda":
            host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            host.copy_(token_ids, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        num_prompt = sum(r.num_computed_tokens < r.num_prompt_tokens for r in requests)
        lazy = [VerifiedChunk(r, r.num_computed_tokens, start, 1) for r, start in zip(requests, out.token_starts)
                if r.spec.enabled]
        if lazy:  # cap 0: the drafters queue this step's features; a synchronous step catches them up
            self._observe(lazy, out.aux_hidden)
            self._lazy_draft_steps += 1
        for r in requests:  # last: a launch that raised above has changed no request (nor consumed a uniform)
            r.num_computed_tokens += 1
            r.num_pending_tokens += 1
            if r.rng is not None and not r.params.greedy:
                r.rng.advance(1)
        return InFlightStep(sched, token_ids, host, copied, num_prompt)

    def _commit_decode(self, step: InFlightStep) -> list[RequestOutput]:
        """Read an in-flight step's tokens (waits for it) and commit them; requests that finished meanwhile (their
        row was computed for nothing) are skipped."""
        if step.copied is not None:
            step.copied.synchronize()  # this step's tokens, not the one launched after it
        token_ids = step.host_token_ids.tolist()
        now, previous_commit = time.perf_counter(), self._async_commit_time
        self._async_commit_time = now
        outputs = []
        for s, tok in zip(step.sched.scheduled, token_ids):
            req = s.request
            req.num_pending_tokens -= 1
            if not req.finished:
                outputs.append(self._commit(req, [tok]))
        num_emitted = sum(len(o.new_token_ids) for o in outputs)
        if self._in_flight is not None and self._lazy_draft_steps >= self._lazy_limit():
            self._catch_up_behind()
        if self.spec_policy is not None and previous_commit is not None and any(
                s.request.spec.enabled for s in step.sched.scheduled):
            # a cap-0 step of a run of overlapped steps: one step's time is the time between two commits
            self.spec_policy.record(len(step.sched.scheduled), 0, now - previous_commit, num_emitted)
        self._record_step(step.sched, num_emitted, {}, {}, step.num_prompt_tokens)
        return outputs

    def _catch_up_behind(self) -> None:
        """At cap 0, once the drafters hold ``_lazy_limit()`` steps' entries: catch them up on every entry whose
        next token is now committed, enqueued behind the step in flight (whose own entries stay queued), instead of
        ending the run of overlapped steps with a synchronous step that does it. Proposers without ``catch_up``
        (n-gram, draft model) queue nothing: for them the run no longer ends at all. The catch-up's time falls
        between two commits, so cap 0's measured steps pay for it. Stop 29 on the H200 (SmolLM2, GSM8K at
        concurrency 8, the policy pinned to cap 0): 0.93x of plain decoding with the synchronous catch-up, 0.92x
        with this one (``benchmarks/results/step_trace_gsm8k_c8_pinned_gpu.json``, ``_overlap_gpu.json``): the
        lost overlap was not what cost. The catch-up itself is, about 1.2 ms every 14 steps at batch 8, most of it
        host work (Python building the ingest of 8 x 14 entries), next to 1 ms steps. Since stop 30 the ingest is
        staged with numpy and an EAGLE-3 drafter catches up 63 steps at a time at batch 8 (``lazy_steps``)."""
        left = 0
        for proposer in self.proposers.values():
            catch_up = getattr(proposer, "catch_up", None)
            if catch_up is not None:
                left = max(left, catch_up())
        self._lazy_draft_steps = left  # the in-flight step's entries (only its requests have uncommitted ones)

    def _draft(self, chunks: list[VerifiedChunk], aux_hidden: dict[int, torch.Tensor]) -> None:
        """Show each proposer what its requests verified this step, then let it draft for those now decoding
        (no more drafts each than the adaptive policy's cap, when it runs)."""
        wanted = []  # (proposer, requests that may draft, their draft counts)
        single = True  # every observed chunk is one decode token (a prefill chunk is never left queued)
        for proposer, mine in self._observe(chunks, aux_hidden):
            drafting = [(c.request, n) for c in mine if (n := self._num_spec_tokens(c.request)) > 0]
            wanted.append((proposer, [r for r, _ in drafting], [n for _, n in drafting]))
            single = single and all(c.num_tokens == 1 for c in mine)
        self._spec_decided = False
        ahead, self._cap_ahead = self._cap_ahead, None
        if self.spec_policy is not None and any(requests for _, requests, _ in wanted):
            cap = ahead[0] if ahead is not None else self.spec_policy.choose(self.num_running)
            self._spec_cap, self._spec_decided = cap, True
            if self._spec_cap == 0 and single and self._lazy_draft_steps < self._lazy_limit():
                # Nobody drafts: the drafters catch up on these tokens at a later step, in one pass over
                # several steps' tokens (a head's layer costs about as much for 16 rows as for 1), bounded so
                # that the queued target features stay few (at most ``_lazy_limit()`` rows per request).
                self._lazy_draft_steps += 1
                self._caught_up = False
                return
        self._caught_up = self._lazy_draft_steps > 0
        self._lazy_draft_steps = 0
        for proposer, requests, counts in wanted:
            if self._spec_decided and self._spec_cap is not None:
                counts = [min(n, self._spec_cap) for n in counts]
                requests = [r for r, n in zip(requests, counts) if n > 0]
                counts = [n for n in counts if n > 0]
            for req, num_spec, draft in zip(requests, counts, proposer.propose(requests, counts)):
                req.spec_token_ids = list(draft.token_ids[:num_spec])
                req.spec_draft_probs = None if draft.probs is None else draft.probs[:len(req.spec_token_ids)]

    def _observe(self, chunks: list[VerifiedChunk], aux_hidden: dict[int, torch.Tensor]):
        """Show each proposer its requests' verified chunks; returns [(proposer, its chunks)]."""
        shown = []
        for method, proposer in self.proposers.items():
            mine = [c for c in chunks if c.request.spec.method == method and not c.request.finished]
            if not mine:
                continue
            aux = torch.cat([aux_hidden[i] for i in proposer.aux_layer_ids], dim=-1) if proposer.aux_layer_ids \
                else None
            proposer.observe(mine, aux)
            shown.append((proposer, mine))
        return shown

    def _num_spec_tokens(self, req: Request) -> int:
        """Drafts worth proposing: none while prefilling; never more than could be committed (all accepted
        plus the bonus token must fit in max_tokens and the context limit)."""
        if not req.spec.enabled or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        return max(0, min(req.spec.num_spec_tokens, req.params.max_tokens - len(req.output_ids) - 1,
                          self.max_model_len - req.num_tokens - 1))

    def _free_spec_state(self, req: Request) -> None:
        proposer = self.proposers.get(req.spec.method)
        if proposer is not None:
            proposer.free(req.request_id)

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
            if reason is None and req.num_committed_tokens >= self.max_model_len:
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
        self._free_spec_state(req)
        if req.detokenizer is not None and req.finish_reason != "abort":
            req.output_text += req.detokenizer.flush()  # bytes held back for an incomplete character
        del self.requests[req.request_id]
        if self.metrics is not None:
            self.metrics.record_request(self._request_stats(req))
        return RequestOutput(req.request_id, emitted, self._take_text(req), True, req.finish_reason,
                             req.num_prompt_tokens, len(req.output_ids), req.spec.method, req.spec_counters,
                             req.spec.num_spec_tokens if req.spec.enabled else 0)

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
            spec_method=req.spec.method,
            spec=req.spec_counters,
        )

    def record_idle(self) -> None:
        """Publish queue and cache gauges outside a step (after an abort, say)."""
        self._record_step(SchedulerOutput(), 0, {}, {})

    def _record_step(self, sched: SchedulerOutput, num_emitted: int, spec: dict[str, SpecCounters],
                     emitted_per_step: dict[str, list[int]], prompt_tokens: int | None = None) -> None:
        """``prompt_tokens``: counted at launch by an asynchronous step (its requests have moved on since);
        otherwise from ``sched`` and the requests' progress right after the step."""
        if self.metrics is None:
            return
        if prompt_tokens is None:
            prompt_tokens = sum(
                max(0, min(s.request.num_computed_tokens, s.request.num_prompt_tokens)
                    - max(0, s.request.num_computed_tokens - s.num_new_tokens))
                for s in sched.scheduled)
        self.metrics.record_step(StepStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=self.block_manager.usage(),
            num_prompt_tokens=prompt_tokens,
            num_generation_tokens=num_emitted,
            num_preemptions=len(sched.preempted),
            spec=spec,
            spec_emitted_per_step=emitted_per_step,
            spec_draft_cap=None if self.spec_policy is None else -1 if self._spec_cap is None else self._spec_cap,
        ))

    # ---- offline convenience -------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 spec: SpecParams | list[SpecParams] | None = None,
                 on_step: Callable[[list[Request]], None] | None = None) -> list[Request]:
        """Run prompts to completion; returns the finished requests (output_ids, output_text) in order.
        ``on_step`` (e.g. a progress line) sees the requests after every step."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        slist = spec if isinstance(spec, list) else [spec] * len(prompts)
        ids = [f"offline-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        reqs = []
        for rid, prompt, p, sp in zip(ids, prompts, plist, slist):
            self.add_request(rid, prompt, p, sp)
            reqs.append(self.requests[rid])
        while any(not r.finished for r in reqs):
            self.step()
            if on_step is not None:
                on_step(reqs)
        return reqs
