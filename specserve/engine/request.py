"""A request's life inside the engine: tokens, KV progress, stop conditions, timestamps.

``all_ids = prompt_ids + output_ids``; ``num_computed_tokens`` of them have KV in the cache. The last
sampled token has no KV yet, so a decoding request schedules ``num_tokens - num_computed_tokens == 1``
token, plus its draft tokens ``spec_token_ids`` when it speculates; a request preempted by recompute
restarts at ``num_computed_tokens = 0`` and prefills its prompt and its outputs again before sampling the
next token.

Asynchronous decode steps (``engine.py``) schedule a step before the previous one's tokens reach the host:
those tokens are pending (``num_pending_tokens``): counted in ``num_tokens``, read as ``PENDING_TOKEN_ID`` by
``token_at`` / ``token_slice`` (the runner takes them from the device), and appended to ``output_ids`` when
the step that sampled them is committed.

    prompt [p0 p1 p2], output_ids [o0], 1 pending:  num_tokens 5, token_slice(3, 5) == [o0, -1]
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specserve.sampling import SamplingParams
from specserve.spec.params import SPEC_OFF, SpecCounters, SpecParams

if TYPE_CHECKING:
    from specserve.layers.sampler import TokenUniforms

PENDING_TOKEN_ID = -1  # a sampled token still on the device (see num_pending_tokens)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What the engine reports for a request after a step."""

    request_id: str
    new_token_ids: list[int]  # tokens emitted this step
    new_text: str  # detokenized delta; text from a stop string on never appears
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    spec_method: str = "none"  # the request's speculative method ("none" = off)
    spec_counters: SpecCounters | None = None  # set on the final output of a request
    num_spec_tokens: int = 0  # drafts per step the request asked for (its speculation's k; 0 = off)


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0  # sampled by a step not yet committed (asynchronous decode steps)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    rng: TokenUniforms | None = None  # the request's own stream of uniforms (sampled requests)
    # text state
    output_text: str = ""  # full detokenized text, truncated at a stop string
    num_text_emitted: int = 0  # chars of output_text already streamed
    detokenizer: object | None = None
    # timestamps (time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # speculative decoding
    spec: SpecParams = SPEC_OFF
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next step
    spec_draft_probs: torch.Tensor | None = None  # [len(spec_token_ids), vocab_size]; None = one-hot drafts
    spec_counters: SpecCounters = field(default_factory=SpecCounters)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending_tokens

    @property
    def num_committed_tokens(self) -> int:
        """Prompt and committed output tokens (``num_tokens`` without the pending ones)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_at(self, index: int) -> int:
        n = len(self.prompt_ids)
        if index < n:
            return self.prompt_ids[index]
        return self.output_ids[index - n] if index - n < len(self.output_ids) else PENDING_TOKEN_ID

    def token_slice(self, start: int, stop: int) -> list[int]:
        known = self.num_committed_tokens
        pending = [PENDING_TOKEN_ID] * (stop - max(start, known)) if stop > known else []
        stop = min(stop, known)
        n = len(self.prompt_ids)
        if start >= stop:
            return pending
        if stop <= n:
            return self.prompt_ids[start:stop] + pending
        if start >= n:
            return self.output_ids[start - n:stop - n] + pending
        return self.prompt_ids[start:] + self.output_ids[:stop - n] + pending
