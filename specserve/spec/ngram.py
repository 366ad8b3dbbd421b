"""N-gram drafting, a.k.a. prompt lookup decoding (Saxena, 2023, github.com/apoorvumang/prompt-lookup-decoding;
Yang et al., "Inference with Reference", arXiv 2304.04487): when the last n tokens of a sequence occurred
before, the tokens that followed that earlier occurrence are a good guess for what comes next. Code edits,
summaries, RAG answers and "repeat after me" prompts copy long spans, so acceptance is high there and the
draft costs no model call at all.

    tokens = [5 7 9 2 5 7 | ?]   ngram_max 3 -> suffix [2 5 7] not seen before; n = 2 -> suffix [5 7] at
    index 0, followed by [9 2 5 ...] -> draft [9 2 5] for num_spec_tokens = 3
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specserve.engine.request import Request
from specserve.spec.proposer import Draft, VerifiedChunk


def ngram_lookup(
    token_ids: np.ndarray,  # [num_tokens] int64
    ngram_min: int,
    ngram_max: int,
    num_spec_tokens: int,
) -> list[int]:
    """Draft up to ``num_spec_tokens`` tokens: the continuation of the most recent earlier occurrence of the
    longest suffix n-gram (n from ``ngram_max`` down to ``ngram_min``). Empty when nothing matches."""
    num_tokens = len(token_ids)
    for n in range(min(ngram_max, num_tokens - 1), ngram_min - 1, -1):
        # Windows start at 0 .. num_tokens - n - 1: every earlier occurrence, never the suffix itself,
        # and each one is followed by at least one token.
        windows = sliding_window_view(token_ids[:-1], n)  # [num_tokens - n, n]
        hits = np.flatnonzero((windows == token_ids[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return token_ids[start:start + num_spec_tokens].tolist()
    return []


class NgramProposer:
    method = "ngram"
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def observe(self, chunks: list[VerifiedChunk], aux_hidden) -> None:
        pass

    def propose(self, requests: list[Request], num_spec_tokens: list[int]) -> list[Draft]:
        drafts = []
        for req, k in zip(requests, num_spec_tokens):
            ids = np.fromiter(req.prompt_ids, dtype=np.int64, count=len(req.prompt_ids))
            if req.output_ids:
                ids = np.concatenate([ids, np.asarray(req.output_ids, dtype=np.int64)])
            drafts.append(Draft(ngram_lookup(ids, self.ngram_min, self.ngram_max, k)))
        return drafts

    def free(self, request_id: str) -> None:
        pass
