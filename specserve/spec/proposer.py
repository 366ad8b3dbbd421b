"""The proposer protocol: what the engine asks of every drafter (n-gram lookup, draft model, EAGLE-3, P-EAGLE).

Each step the engine runs the target over every request's last token and its drafts, verifies, commits the
emitted tokens, and then talks to each proposer in two calls:

    observe(chunks, aux_hidden)  the target positions whose KV survived verification this step, with the
                                 target's hidden states for them (EAGLE heads read those; others ignore them)
    propose(requests, counts)    draft ``counts[i]`` tokens after the last token of ``requests[i]``

and ``free(request_id)`` whenever a request finishes or is preempted (a preempted request is recomputed from
scratch, and the proposer rebuilds its own state for it from the next ``observe`` calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.engine.request import Request


@dataclass
class Draft:
    token_ids: list[int]  # [num_draft_tokens] target-vocabulary ids
    # [num_draft_tokens, vocab_size] distribution each token was sampled from; None: deterministic (one-hot)
    probs: torch.Tensor | None = None


@dataclass
class VerifiedChunk:
    """A request's tokens this step whose target KV was kept: positions ``position_start ..
    position_start + num_tokens - 1``, packed rows ``token_start ..`` of the step's hidden states."""

    request: Request
    position_start: int
    token_start: int
    num_tokens: int


class Proposer(Protocol):
    method: str  # "ngram" | "draft" | "eagle3" | "peagle"
    aux_layer_ids: tuple[int, ...]  # target layers whose input hidden states observe() needs; () for none

    def observe(
        self,
        chunks: list[VerifiedChunk],
        aux_hidden: torch.Tensor | None,  # [num_step_tokens, len(aux_layer_ids) * target_hidden_size]
    ) -> None: ...

    def propose(self, requests: list[Request], num_spec_tokens: list[int]) -> list[Draft]: ...

    def free(self, request_id: str) -> None: ...
