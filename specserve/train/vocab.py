"""The draft vocabulary: the head scores only the ``draft_vocab_size`` target tokens the target generates
most often (EAGLE-3, arXiv 2503.01840, uses a reduced LM head; FR-Spec, arXiv 2502.14856, measures how much
of the probability mass a frequency-ranked subset keeps). Stored as in the speculators format:

    draft_ids = the chosen target ids, ascending      e.g. [3, 7, 8]
    d2t[i]    = draft_ids[i] - i   (target = i + d2t[i])     [3, 6, 6]
    t2d[t]    = t is in the draft vocabulary (bool, target vocab long)
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.train.generate import Sample


def token_counts(samples: list[Sample], vocab_size: int) -> np.ndarray:  # [vocab_size] int64
    """How often each target token appears in the generated answers (prompts excluded)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in samples:
        answer = np.asarray(s.token_ids[s.num_prompt:], dtype=np.int64)
        if answer.size:
            counts += np.bincount(answer, minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> torch.Tensor:  # [draft_vocab_size] int64
    """The ``draft_vocab_size`` most frequent ids, ascending; ties broken by the lower id (stable)."""
    return extend_vocab(torch.empty(0, dtype=torch.int64), counts, draft_vocab_size)


def extend_vocab(keep: torch.Tensor, counts: np.ndarray, draft_vocab_size: int) -> torch.Tensor:
    """A trained head's vocabulary ``keep`` [n] (target ids) grown to ``draft_vocab_size`` with the most frequent
    other ids of ``counts``, ascending (a warm start that widens the head keeps every token it has learnt).
    No smaller than ``keep``: ``draft_vocab_size <= n`` gives ``keep`` sorted.

        keep = [2, 5], counts = [9, 0, 1, 7, 0, 3], size 4  ->  [0, 2, 3, 5]   (0 and 3: the most frequent others)
    """
    if draft_vocab_size > len(counts):
        raise ValueError(f"draft_vocab_size: {draft_vocab_size} exceeds the target vocabulary ({len(counts)})")
    kept = np.zeros(len(counts), dtype=bool)
    kept[keep.numpy()] = True
    others = np.argsort(-np.where(kept, -1, counts), kind="stable")[:max(0, draft_vocab_size - int(kept.sum()))]
    return torch.from_numpy(np.sort(np.concatenate([np.flatnonzero(kept), others]))).to(torch.int64)


def d2t_t2d(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``draft_ids`` [draft_vocab] ascending -> (d2t [draft_vocab] int64 offsets, t2d [vocab_size] bool)."""
    d2t = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def coverage(counts: np.ndarray, draft_ids: torch.Tensor) -> float:
    """Share of generated tokens inside the draft vocabulary (the ceiling on first-token acceptance)."""
    total = counts.sum()
    return float(counts[draft_ids.numpy()].sum() / total) if total else 0.0
