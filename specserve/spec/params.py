"""Per-request speculative-decoding parameters and the counters that describe how speculation went.

Vocabulary (DESIGN.md): accepted tokens are draft tokens the verifier kept; the recovered token is the
verifier's own sample at the first rejection; the bonus token is its sample after a fully accepted draft.
acceptance rate = accepted / drafted; mean acceptance length (AL) = 1 + accepted / drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.config import MAX_NUM_SPEC_TOKENS, SPEC_METHODS


@dataclass(frozen=True)
class SpecParams:
    """How one request speculates: ``method`` "none" (off) or a loaded proposer, and its ``num_spec_tokens``."""

    method: str = "none"
    num_spec_tokens: int = 0

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative.method: must be one of {', '.join(SPEC_METHODS)}")
        if not 0 <= self.num_spec_tokens <= MAX_NUM_SPEC_TOKENS:
            raise ValueError(f"speculative.num_spec_tokens: must be in [0, {MAX_NUM_SPEC_TOKENS}]")

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_spec_tokens > 0


SPEC_OFF = SpecParams()


@dataclass
class SpecCounters:
    """Draft and acceptance counts, kept per request and summed per step and method.

    ``accepted_per_pos[i]`` counts drafts whose token at position i (0-based) was accepted;
    ``acceptance_histogram[n]`` counts drafts with exactly n accepted tokens.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    acceptance_histogram: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified draft of ``num_draft_tokens`` tokens of which the first ``num_accepted`` were kept."""
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        _grow(self.accepted_per_pos, num_accepted)
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        _grow(self.acceptance_histogram, num_accepted + 1)
        self.acceptance_histogram[num_accepted] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


def _grow(values: list[int], length: int) -> None:
    if len(values) < length:
        values.extend([0] * (length - len(values)))
