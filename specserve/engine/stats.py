"""Plain records the engine loop hands to the metrics sink: one per step, one per finished request."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.spec.params import SpecCounters


@dataclass
class StepStats:
    num_running: int  # requests scheduled or holding KV after this step
    num_waiting: int  # requests queued, not yet admitted (preempted ones included)
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    num_prompt_tokens: int  # prompt (prefill) tokens computed this step
    num_generation_tokens: int  # output tokens emitted this step
    num_preemptions: int  # requests preempted (recompute) this step
    spec: dict[str, SpecCounters] = field(default_factory=dict)  # method -> drafts verified this step
    spec_emitted_per_step: dict[str, list[int]] = field(default_factory=dict)  # method -> tokens each request emitted
    spec_draft_cap: int | None = None  # adaptive speculation's cap for the next step (-1: none); None: policy off


@dataclass
class RequestStats:
    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float  # seconds from arrival to first scheduling
    time_to_first_token: float | None  # seconds from arrival to first output token; None if none
    time_per_output_token: float | None  # mean seconds between output tokens; None if fewer than 2
    e2e_latency: float  # seconds from arrival to finish
    spec_method: str = "none"
    spec: SpecCounters = field(default_factory=SpecCounters)
