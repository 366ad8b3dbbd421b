"""Split-K reduced inside one launch, shared by the GEMM / GEMV kernels (``triton_w8a16.py``,
``triton_w4a16.py``, ``triton_gemv.py``), and ``pick_rows``, how their GEMV paths assemble the output tile.

At decode sizes a GEMM is a GEMV bound by weight bandwidth, and tiling only the N output channels can leave
multiprocessors idle (N = 4096 at BLOCK_N = 64 is 64 programs for 132 SMs). Splitting K across ``SPLIT_K``
programs per output tile fixes that, but the usual ways to add the partial sums cost launches: an fp32
``[SPLIT_K, M, N]`` buffer summed by a second kernel, or ``atomic_add`` into an fp32 output that must first be
zeroed and afterwards cast. Here the reduction stays in the GEMM launch ("the last program reduces"):

1. every program stores its fp32 partial tile into ``partial [SPLIT_K, M, N]``;
2. a CTA barrier (every thread's stores issued), then one atomic increment of the tile's arrival counter with
   acquire-release semantics at GPU scope (the stores are visible to whoever reads the new count);
3. the program that sees count ``SPLIT_K - 1`` is the last: it reads all ``SPLIT_K`` partials back in split
   order (deterministic, whatever the arrival order; ``.cg`` loads go to L2, the coherence point), resets the
   counter to 0 and runs the epilogue (scales, bias, cast) once for the tile; the others store nothing more.

The counters are an int32 buffer that is zero before every launch and left zero after it, so a layer can own
one for its lifetime (``split_counters``) and CUDA graphs can replay launches that use it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specserve.layers.quant_tiles import TileConfig


@triton.jit
def splitk_reduce(
    acc,  # [BLOCK_M, BLOCK_N] fp32 partial sums of this program (its K range)
    offs_m,  # [BLOCK_M] row indices of the tile
    offs_n,  # [BLOCK_N] column indices of the tile
    M, N,
    partial_ptr,  # [SPLIT_K, M, N] fp32, contiguous
    count_ptr,  # [num_tiles] int32 arrival counters, zero before and after the launch
    tile,  # this output tile's counter index
    pid_k,  # this program's split, 0 .. SPLIT_K - 1
    SPLIT_K: tl.constexpr,
):
    """Returns ``(acc, is_last)``: for the last of the tile's ``SPLIT_K`` programs to arrive, the sum of all
    partials in split order and True; for the others, their own partial and False (they must not store)."""
    c_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    p_ptrs = partial_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(p_ptrs + pid_k * M * N, acc, mask=c_mask)
    tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    is_last = arrived == SPLIT_K - 1
    if is_last:
        acc = tl.load(p_ptrs, mask=c_mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(p_ptrs + s * M * N, mask=c_mask, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + tile, 0)  # ready for the next launch
    return acc, is_last


@triton.jit
def pick_rows(
    rows,  # [BLOCK_M, 1] row offsets within the tile, 0 .. BLOCK_M - 1
    v0, v1, v2, v3,  # row r's values, each broadcastable against rows ([1, BLOCK_N] sums, or scalars)
    fill,  # the value of rows past BLOCK_M's (never read: BLOCK_M is 1, 2 or 4)
    BLOCK_M: tl.constexpr,
):
    """The ``[BLOCK_M, ...]`` tile whose row ``r`` is ``v_r``: a GEMV path keeps one accumulator per row (2D,
    in the weight tile's layout) and assembles its output tile from their sums here. ``v_r`` past ``BLOCK_M`` are
    not read (their sums are dead code and compiled away)."""
    out = tl.where(rows == 0, v0, fill)
    if BLOCK_M > 1:
        out = tl.where(rows == 1, v1, out)
    if BLOCK_M > 2:
        out = tl.where(rows == 2, v2, out)
        out = tl.where(rows == 3, v3, out)
    return out


@functools.cache
def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device``; 4 on CPU (the interpreter), so tests still exercise split K."""
    if device.type == "cpu":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_split_k(config: TileConfig, k_tiles: int, num_tiles: int, device: torch.device, waves: int = 2,
                   min_tiles_per_split: int = 2) -> int:
    """``config.split_k``, or for 0 (auto): enough programs for ``waves`` waves of the multiprocessors, each
    split at least ``min_tiles_per_split`` of the ``k_tiles`` K tiles long; 1 when the output tiles suffice."""
    if config.split_k > 0:
        return config.split_k
    want = triton.cdiv(waves * num_sms(device), num_tiles)
    return max(1, min(want, k_tiles // min_tiles_per_split))


def split_plan(config: TileConfig, k: int, block_k: int, num_tiles: int,
               device: torch.device) -> tuple[int, int]:
    """``(split_k, k_per_split)``: K cut into ``split_k`` ranges of ``k_per_split`` (a multiple of ``block_k``),
    none empty."""
    k_tiles = triton.cdiv(k, block_k)
    split = max(1, min(choose_split_k(config, k_tiles, num_tiles, device), k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * block_k
    return triton.cdiv(k, k_per_split), k_per_split


def split_counters(n: int, device: torch.device) -> torch.Tensor:  # [cdiv(n, 8) * 4] int32 zeros
    """A zeroed arrival-counter buffer for split-K launches over ``n`` output channels (BLOCK_N >= 8, up to 4
    row tiles); a layer allocates it once, the kernels leave it zeroed."""
    return torch.zeros(triton.cdiv(n, 8) * 4, dtype=torch.int32, device=device)


def split_buffers(split: int, m: int, n: int, num_tiles: int, counters: torch.Tensor | None,
                  device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(partial [split, m, n] fp32, counters [>= num_tiles] int32)`` for a split launch (``counters`` if it is
    large enough, else a fresh zeroed buffer); ``(None, None)`` when ``split == 1``."""
    if split == 1:
        return None, None
    partial = torch.empty((split, m, n), dtype=torch.float32, device=device)
    if counters is None or counters.numel() < num_tiles:
        counters = torch.zeros(num_tiles, dtype=torch.int32, device=device)
    return partial, counters
