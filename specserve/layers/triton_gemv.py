"""Triton GEMV for 16-bit (bf16 / fp16) weights at decode row counts: ``out = x @ W.T (+ bias)`` for ``x [M, K]``
and ``W [N, K]`` of the same 16-bit dtype, fp32 accumulation, output in that dtype. Opt-in: ``Linear`` (and the LM
head through ``layers/linear.dense_linear``) routes ``0 < M <= quant_tiles.BF16_GEMV_MAX_ROWS`` rows here; the
default (0) keeps cuBLAS.

Why. At batch 1 a decode step is a chain of GEMVs that read every weight byte once and do two FLOPs per weight
(per row): the step's time is the weights' bytes over the memory bandwidth. cuBLAS's bf16 GEMV reaches ~87% of
the H200's copy bandwidth on Llama-3.1-8B's projections while the W8A16 GEMV (``layers/triton_w8a16.py``, same
structure) reached 93.5% on the LM-head shape, so the same design on 16-bit weights may shave several percent
off the step. ``benchmarks/quant_gemm_gpu.py`` (method ``bf16_triton``) decides where it wins.

Design (the W8A16 kernel's GEMV path, without the FP8 conversion and the scales):

- Output channels are tiled by ``BLOCK_N``; a program streams its ``BLOCK_N x K`` slab of weights, ``BLOCK_K``
  contiguous elements per row per loop step (16-byte vector loads, 8 weights each), and keeps all rows of its
  row tile (``BLOCK_M`` of 1, 2 or 4; M > 4 runs several row tiles, each reading the weights again): each weight
  byte is read once per row tile.
- CUDA cores, not tensor cores: fp32 FMAs into one ``[BLOCK_N, BLOCK_K]`` fp32 accumulator per row, reduced over
  K once after the loop; the weight tile stays in the registers it was loaded into (an MMA would need 16 rows, 15
  of them padding, and its operands staged through shared memory). Per weight: one conversion to fp32 and one
  FMA per row, far below the issue rate a bandwidth-bound loop leaves.
- With few output tiles (a narrow N) K can be split (``split_k``); the partial sums are reduced inside the same
  launch by the last program of a tile (``layers/triton_splitk.py``): deterministic, no second kernel.

Tile configurations come from ``quant_tiles.BF16_GEMV_TILES`` at call time (``override`` applies; a CUDA graph
keeps what it captured). Triton is imported by this module only; callers import it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.layers.quant_tiles import BF16_GEMV_TILES, TileConfig
from specserve.layers.triton_pdl import pdl_args, pdl_begin
from specserve.layers.triton_splitk import pick_rows, split_buffers, split_plan, splitk_reduce

GEMV_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] bf16 / fp16 activations (any strides)
    w_ptr,  # [N, K] weights, x's dtype, one row per output channel
    bias_ptr,  # [N] (read only when HAS_BIAS)
    out_ptr,  # [M, N] x's dtype
    partial_ptr,  # [SPLIT_K, M, N] fp32 partial sums (SPLIT_K > 1 only)
    count_ptr,  # [grid_m * grid_n] int32 arrival counters (SPLIT_K > 1 only)
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    pdl_begin(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    row0 = pid_m * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_kb = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1] row starts
    x_row = x_ptr + row0 * stride_xm
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # k_per_split is a multiple of BLOCK_K: no tile straddles splits
    # acc_r[n, k'] sums x[r, k] * w[n, k] over k = k' (mod BLOCK_K); 2D per-row accumulators keep the weight tile
    # in its load layout (a 3D [M, N, K] product would shuffle it through shared memory). Rows >= BLOCK_M: unbuilt.
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + offs_kb
        k_mask = offs_k < K
        w_ptrs = w_rows + offs_k[None, :] * stride_wk  # [BLOCK_N, BLOCK_K]
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        w = w.to(tl.float32)  # exact
        x_ptrs = x_row + offs_k * stride_xk  # [BLOCK_K] of row row0
        acc0 += w * tl.load(x_ptrs, mask=k_mask & (row0 < M), other=0.0).to(tl.float32)[None, :]
        if BLOCK_M > 1:
            acc1 += w * tl.load(x_ptrs + stride_xm, mask=k_mask & (row0 + 1 < M), other=0.0).to(tl.float32)[None, :]
        if BLOCK_M > 2:
            acc2 += w * tl.load(x_ptrs + 2 * stride_xm, mask=k_mask & (row0 + 2 < M),
                                other=0.0).to(tl.float32)[None, :]
            acc3 += w * tl.load(x_ptrs + 3 * stride_xm, mask=k_mask & (row0 + 3 < M),
                                other=0.0).to(tl.float32)[None, :]
    rows = offs_m[:, None] - row0  # [BLOCK_M, 1]: 0 .. BLOCK_M - 1
    acc = pick_rows(rows, tl.sum(acc0, axis=1)[None, :], tl.sum(acc1, axis=1)[None, :],
                    tl.sum(acc2, axis=1)[None, :], tl.sum(acc3, axis=1)[None, :], 0.0, BLOCK_M)  # [BLOCK_M, BLOCK_N]
    c_mask = (offs_m < M)[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        acc, is_last = splitk_reduce(acc, offs_m, offs_n, M, N, partial_ptr, count_ptr,
                                     pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT_K)
        c_mask = c_mask & is_last
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=c_mask)


def gemv_supported(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> bool:
    """Whether ``gemv_linear`` takes these operands: 2D x, a contiguous 16-bit weight of x's dtype and device, a
    bias (if any) of the same dtype."""
    return (x.dim() == 2 and weight.dim() == 2 and weight.dtype in GEMV_DTYPES and x.dtype == weight.dtype
            and x.device == weight.device and weight.is_contiguous() and x.shape[1] == weight.shape[1]
            and (bias is None or (bias.dtype == weight.dtype and bias.dim() == 1)))


def gemv_linear(
    x: torch.Tensor,  # [num_rows, in_features] bf16 / fp16
    weight: torch.Tensor,  # [out_features, in_features], x.dtype
    bias: torch.Tensor | None = None,  # [out_features], x.dtype
    config: TileConfig | None = None,
    counters: torch.Tensor | None = None,  # [>= grid tiles] int32 zeros, for split-K launches
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [num_rows, out_features], out_dtype (default x.dtype)
    """``F.linear(x, weight, bias)`` in one launch with fp32 sums (up to summation order; one rounding of the fp32
    result to ``out_dtype``, bias added in fp32; ``out_dtype=torch.float32`` keeps the sums unrounded, as the LM
    head wants its logits). Meant for a few rows (a row tile holds at most 4; more rows re-read the weights
    per tile). ``config`` defaults to ``BF16_GEMV_TILES``'s entry for (M, N, K) (only ``block_n``, ``block_k``,
    ``split_k``, ``num_warps``, ``num_stages`` are used); ``counters`` (``triton_splitk.split_counters``) to a
    fresh zeroed buffer when the configuration splits K."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x: in_features {k} != weight in_features {weight.shape[1]}")
    if x.dtype not in GEMV_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"gemv_linear takes bf16 / fp16 x and weight of one dtype, got {x.dtype}, {weight.dtype}")
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    cfg = config or BF16_GEMV_TILES.lookup(m, n, k)
    block_m, block_n = min(4, triton.next_power_of_2(m)), cfg.block_n
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    grid_m, grid_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    split, k_per_split = split_plan(cfg, k, block_k, grid_m * grid_n, x.device)
    partial, counters = split_buffers(split, m, n, grid_m * grid_n, counters, x.device)
    _gemv_kernel[(grid_n, grid_m, split)](
        x, weight, weight if bias is None else bias, out,
        out if partial is None else partial, weight if counters is None else counters,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        EVEN_K=k % block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device),
    )
    return out
