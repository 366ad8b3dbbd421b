"""Per-request sampling parameters. A temperature below ``GREEDY_TEMPERATURE`` (0 included) means greedy: the
sampler divides fp32 logits by the temperature, and a tiny one (1e-40 is 0 or a denormal in fp32) turns them into
infinities and the softmax into NaNs, so such a request is decoded greedily, which is what its distribution
approaches anyway (vLLM draws the line at the same 1e-5)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this sample greedily (the module docstring says why).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens: must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature: must be non-negative")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p: must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k: must be -1, 0 (disabled) or positive")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
