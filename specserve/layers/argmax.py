"""Greedy tokens: ``logits.argmax(dim=-1)`` for a few rows over a large vocabulary, split so that the GPU reads
the row in parallel.

Why. torch reduces a row's argmax in one thread block, so for a handful of rows the whole 128k-entry row of a
Llama-3 vocabulary streams through one multiprocessor: on an H200 that took 27 us at batch 1 and about the same at
batch 32 (``benchmarks/results/decode_kernels_gpu_before.json``), about 1% of an FP8 decode step. Here the row is
viewed as ``chunks`` equal slices: one ``max`` over each slice (``rows x chunks`` blocks in parallel), an
``argmax`` over the ``chunks`` slice maxima, and the winning slice's index. That is five small launches instead of
one, so only rows of at least ``SPLIT_MIN_VOCAB`` entries take it, where one block's pass is long and the step (an
8B model's) hides the extra host launches; SmolLM2's 49k rows keep ``argmax``, which ``benchmarks/argmax_gpu.py``
timed faster there (below).

Exactly ``argmax``'s answer, ties and NaN included: ``torch.max(dim)`` and ``argmax`` both return the first index
of the maximum (NaN counts as the maximum), so the first slice holding the row's maximum wins the second step and,
inside it, its first index. Example, ``chunks = 2``: row ``[1, 7, 7, 3, 7, 0]`` -> slices ``[1, 7, 7]`` and
``[7, 3, 0]`` -> maxima ``[7, 7]`` at ``[1, 0]`` -> first slice 0 -> token ``0 * 3 + 1 = 1``, as ``argmax``.

Used where greedy tokens are taken from logits: ``sampler.sample_on_device``, the verifier's target argmax and the
drafters' argmaxes. ``benchmarks/argmax_gpu.py`` times both forms and checks them equal on the GPU. On an H100
(``results/argmax_gpu_h100.json``, CUDA-graph replays, fp32 logits of 128256 entries), 26.4 -> 15.7 us at 1 row
(x1.68), 27.0 -> 16.3 at 8, 27.3 -> 16.6 at 32, 27.5 -> 20.1 at 64 (x1.37), and equal on random, tied and NaN
rows. SmolLM2's 49152-entry rows, forced into 64 slices on an H100 (``results/argmax_gpu_h100_stop44.json``):
11.79 -> 11.89 us at 1 row, 12.04 -> 12.52 at 8, 12.29 -> 12.50 at 32, 12.29 -> 14.22 at 64, slower at every row
count, so ``SPLIT_MIN_VOCAB`` keeps them on one launch (the Llama-3 rows' gain repeated in that run: x1.63-1.67
up to 32 rows, x1.36 at 64).
"""

from __future__ import annotations

import torch

SPLIT_MAX_ROWS = 64  # more rows already fill the GPU with torch's one block per row
SPLIT_MIN_VOCAB = 65536  # shorter rows (SmolLM2's 49152) keep one launch: split, they were slower on an H100
CHUNK_COUNTS = (64, 32, 16)  # slices per row, the first that divides the vocabulary


def dividing_chunks(vocab_size: int) -> int:
    """The first of ``CHUNK_COUNTS`` that divides ``vocab_size``, else 1. E.g. 128256 -> 64; 128001 -> 1."""
    return next((c for c in CHUNK_COUNTS if vocab_size % c == 0), 1)


def split_chunks(num_rows: int, vocab_size: int) -> int:
    """Slices per row for ``greedy_argmax`` (1: plain ``argmax``). E.g. (1, 128256) -> 64; (256, 128256) -> 1
    (enough rows); (1, 49152) -> 1 (a short row); (1, 128001) -> 1 (no count divides it)."""
    if num_rows > SPLIT_MAX_ROWS or vocab_size < SPLIT_MIN_VOCAB:
        return 1
    return dividing_chunks(vocab_size)


def greedy_argmax(
    logits: torch.Tensor,  # [num_rows, vocab_size] any float dtype
    chunks: int | None = None,  # slices per row; None -> split_chunks(num_rows, vocab_size)
) -> torch.Tensor:  # [num_rows] int64, logits.argmax(dim=-1)
    """``logits.argmax(dim=-1)`` (first index of the maximum, NaN the largest), read in ``chunks`` slices per row."""
    rows, vocab = logits.shape
    chunks = split_chunks(rows, vocab) if chunks is None else chunks
    if chunks <= 1 or rows == 0:
        return logits.argmax(dim=-1)
    if vocab % chunks:
        raise ValueError(f"chunks: {chunks} does not divide the vocabulary ({vocab})")
    width = vocab // chunks
    slice_max, slice_idx = logits.reshape(rows, chunks, width).max(dim=-1)  # [rows, chunks] each
    best = slice_max.argmax(dim=-1, keepdim=True)  # [rows, 1] first slice holding the row's maximum
    return (best * width + slice_idx.gather(1, best)).squeeze(1)
