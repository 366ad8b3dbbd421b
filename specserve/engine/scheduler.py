"""Continuous batching with chunked prefill (Orca, Yu et al. OSDI'22; Sarathi, Agrawal et al.,
arXiv 2308.16369).

Every step the scheduler hands out a token budget. Running requests go first, in arrival order: a
decoding request costs one token, a request still prefilling costs its next chunk. Then waiting requests
are admitted first-come-first-served while budget, the running-sequence cap and free KV blocks last.
A decoding request with draft tokens costs ``1 + num_spec_tokens`` (its last token and the drafts to
verify); when the budget runs short its drafts are trimmed, never its own token.
When a running request cannot get a KV block, the most recently admitted running request is preempted
by recompute: its blocks are freed and it goes back to the front of the queue, to prefill its prompt and
outputs again later. No request ever holds blocks while it waits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.config import SchedulerConfig
from specserve.engine.block_manager import BlockManager
from specserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens whose KV this step computes, draft tokens included
    num_spec_tokens: int = 0  # of which draft tokens to verify (the request's first num_spec_tokens drafts)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so the step samples a token."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- queue management ----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and release its KV blocks (safe to call for waiting or running requests)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.block_manager.free(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        request.spec_token_ids = []
        request.spec_draft_probs = None
        self.waiting.appendleft(request)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        # 1. Running requests, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            num_spec = min(len(req.spec_token_ids), budget - num_new) if num_new == 1 else 0
            if num_spec and not bm.can_allocate(req.request_id, num_new + num_spec):
                num_spec = 0  # drafts are optional: never preempt another request to verify them
            num_new += num_spec
            while not bm.can_allocate(req.request_id, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # req itself was preempted: it was the newest, nothing after it remains
            bm.allocate(req.request_id, num_new)
            out.scheduled.append(ScheduledRequest(req, num_new, num_spec))
            budget -= num_new
            i += 1

        # 2. Waiting requests, first come first served. Nothing is admitted in a step that preempted.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not bm.can_allocate(req.request_id, num_new):
                break
            self.waiting.popleft()
            bm.allocate(req.request_id, num_new)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return out
