"""Triton W4A16 GEMM: ``out = x @ dequant(qweight, scales, zeros).T (+ bias)`` with 4-bit group-wise weights
(AWQ-style asymmetric groups, Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration", arXiv 2306.00978) and 16-bit (or fp32) activations, in one launch for every M. Layout and
quantization formula: ``layers/quant_gpu.py``.

A program computes a ``[BLOCK_M, BLOCK_N]`` output tile over one range of K. Each K tile lies in one
quantization group (``BLOCK_K`` divides ``group_size``), so it needs one row of scales and zeros. The weight tile
is read as the ``[BLOCK_K // 8, BLOCK_N]`` int32 words that hold it, each word once, and dequantized in fp32
registers without an int -> float conversion: for a 4-bit ``q``, the bits ``q | 0x4B000000`` are the float
``2^23 + q`` exactly, so ``w = (bits_as_float - (2^23 + z)) * s`` is ``(q - z) * s`` with the reference's one
rounding (shift, two logic ops, one add, one multiply per weight).

Two ways to multiply, chosen per row bucket in ``layers/quant_tiles.py``:

- GEMV (``use_dot=False``, M of 1 to 4: decoding, short verify steps): nibble ``j`` of every word is weight row
  ``k = 8 * word + j``, so for each ``j`` the dequantized ``[BLOCK_K // 8, BLOCK_N]`` slice meets the activations
  ``x[:, k0 + 8 * i + j]`` in fp32 FMAs on the CUDA cores, one accumulator per row; nothing goes through shared
  memory but the small activation vectors. The weights stay fp32 (the tensor-core path rounds them to the
  activation dtype first, as ``int4_linear_reference`` does; the GEMV's result is at least as accurate).
- tensor cores (``use_dot=True``): the 8 nibbles of the word tile unpacked into a ``[BLOCK_K // 8, 8, BLOCK_N]``
  tensor, reshaped to ``[BLOCK_K, BLOCK_N]`` (row ``8 * i + j``), rounded to the activation dtype and fed to
  ``tl.dot`` with an fp32 accumulator; Triton pipelines the word loads (``num_stages``), and tiles of up to
  ``OPERANDS_AHEAD_MAX_ROWS`` rows load the activations, scales and zeros of the next K tile while they work on
  this one (``AHEAD``: the same values, so the same bits).

With few output tiles (decode sizes), K is split across programs and the partial sums are reduced inside the
same launch (``layers/triton_splitk.py``): no second kernel, deterministic. Bias and the cast to the output
dtype are in the epilogue.

Triton is imported by this module only; callers import it lazily on the CUDA path (or in tests under
``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from specserve.layers.quant_tiles import W4A16_TILES, TileConfig
from specserve.layers.triton_pdl import pdl_args, pdl_begin
from specserve.layers.triton_splitk import pick_rows, split_buffers, split_plan, splitk_reduce

# Tensor-core tiles of at most this many rows load each K tile's activations, scales and zeros one loop step ahead
# (``AHEAD``; 0: never; read at every call, a CUDA graph keeps what it captured). Triton pipelines the packed weight
# words through shared memory but issues those three loads inside the step that uses them, so every K step waits
# a memory round trip. Whole INT4 engine steps on an H100, two runs (benchmarks/quant_rows_ab_gpu.py, methods int4
# and int4_noahead; benchmarks/results/int4_ahead_ab_h100_run1/2.json), 16-row tiles: decode batch 8 5.53 / 5.57 ->
# 5.34 / 5.34 ms, batch 16 5.75 -> 5.52, a 1-token forward at batch 4 5.84 / 5.53 -> 5.42 / 5.31, an 8-token
# verify at batch 2 (16 rows) 5.89 -> 5.61; logits equal bit for bit. 32-row tiles lost (batch 32 decode +1.4% in
# run 2, the 32-row verify at batch 4 7.45 / 7.15 -> 7.79 / 7.53 ms), and so did the GEMV path (batch 1) with its
# words, scales and zeros a step ahead (3.25 / 3.29 -> 3.38 / 3.39 ms): both load in-step. Not for want of registers:
# compiled for sm_90 (ptxas -v, stop 40) the committed 32-row tile takes 80 registers a thread with the lookahead and
# 128 without, and 18 KB of shared memory against 26 KB, no spills either way.
OPERANDS_AHEAD_MAX_ROWS = 16
_MAGIC_BITS = 0x4B000000  # the bits of the float 2^23: OR-ing a 4-bit q into them gives 2^23 + q
_TWO_23 = tl.constexpr(8388608.0)


@triton.jit
def _x_nibble(
    ptrs,  # [BLOCK_K // 8] pointers to x[row, k0 + 8 * i + J]
    ok,  # the row exists (row < M)
    J: tl.constexpr,
):
    """The activations that meet nibble ``J`` of each word, in fp32, times 16^-(J % 4) (exact)."""
    return tl.load(ptrs, mask=ok, other=0.0).to(tl.float32) * (1.0 / (1 << (4 * (J % 4))))


@triton.jit
def _dot_operands(
    s_ptrs,  # [BLOCK_N] pointers to group 0's scales of the tile's columns
    z_ptrs,  # [BLOCK_N] pointers to group 0's zeros
    a_rows,  # [BLOCK_M, 1] pointers to the tile's activation rows at K = 0
    k,  # first K of the tile
    n_ok,  # [BLOCK_N] columns to load
    m_ok,  # [BLOCK_M] rows to load
    stride_sg, stride_xk,
    GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The tensor-core path's small operands of the K tile at ``k``: its group's scales and zeros ``[BLOCK_N]``
    and the activations ``[BLOCK_M, BLOCK_K]`` (zeros where masked off)."""
    g = k // GROUP_SIZE
    s = tl.load(s_ptrs + g * stride_sg, mask=n_ok, other=0.0)
    z = tl.load(z_ptrs + g * stride_sg, mask=n_ok, other=0.0)
    a = tl.load(a_rows + (k + tl.arange(0, BLOCK_K))[None, :] * stride_xk, mask=m_ok[:, None], other=0.0)
    return s, z, a


@triton.jit
def _w4a16_kernel(
    x_ptr,  # [M, K] activations (bf16 / fp16 / fp32)
    qweight_ptr,  # [K // 8, N] int32
    scales_ptr,  # [K // GROUP_SIZE, N]
    zeros_ptr,  # [K // GROUP_SIZE, N]
    bias_ptr,  # [N] (read only when HAS_BIAS)
    out_ptr,  # [M, N] activation dtype
    partial_ptr,  # [SPLIT_K, M, N] fp32 partial sums (SPLIT_K > 1 only)
    count_ptr,  # [grid_m * grid_n] int32 arrival counters (SPLIT_K > 1 only)
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_om, stride_on,
    magic,  # 0x4B000000 (the bits of 2^23), passed at run time: in a register, ptxas fuses mask | magic
    GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
    AHEAD: tl.constexpr = False,  # tensor cores: load each K tile's activations, scales, zeros a step early
):
    pdl_begin(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_w = tl.arange(0, BLOCK_K // 8)  # word rows of a K tile
    k_lo = pid_k * k_per_split  # K is a multiple of BLOCK_K, k_per_split too: whole tiles only
    k_hi = tl.minimum(k_lo + k_per_split, K)
    q_cols = qweight_ptr + offs_n[None, :] * stride_qn  # [1, BLOCK_N]
    if USE_DOT:
        shifts = tl.arange(0, 8) * 4  # bit offset of nibble j
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a_rows = x_ptr + offs_m[:, None] * stride_xm  # [BLOCK_M, 1]
        s_ptrs = scales_ptr + offs_n * stride_sn  # [BLOCK_N], group 0
        z_ptrs = zeros_ptr + offs_n * stride_sn
        if AHEAD:  # the first K tile's activations, scales and zeros (see the loop)
            s_next, z_next, a_next = _dot_operands(s_ptrs, z_ptrs, a_rows, k_lo, n_mask, m_mask, stride_sg,
                                                   stride_xk, GROUP_SIZE, BLOCK_K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            words = tl.load(q_cols + (k0 // 8 + offs_w)[:, None] * stride_qk, mask=n_mask[None, :], other=0)
            if AHEAD:
                # This tile's small operands were loaded one step earlier; the next tile's are loaded now, so their
                # round trip overlaps this tile's dequantization and MMA (Triton pipelines only the word loads).
                s, z, a = s_next, z_next, a_next
                k1 = k0 + BLOCK_K
                more = k1 < k_hi
                s_next, z_next, a_next = _dot_operands(s_ptrs, z_ptrs, a_rows, k1, n_mask & more, m_mask & more,
                                                       stride_sg, stride_xk, GROUP_SIZE, BLOCK_K)
            else:
                s, z, a = _dot_operands(s_ptrs, z_ptrs, a_rows, k0, n_mask, m_mask, stride_sg, stride_xk,
                                        GROUP_SIZE, BLOCK_K)
            s = s.to(tl.float32)
            z = z.to(tl.float32)
            q = ((words[:, None, :] >> shifts[None, :, None]) & 0xF) | magic  # [BLOCK_K // 8, 8, BLOCK_N]
            w = (q.to(tl.float32, bitcast=True) - (z + _TWO_23)[None, None, :]) * s[None, None, :]
            w = tl.reshape(w.to(a.dtype), (BLOCK_K, BLOCK_N))  # row 8 * i + j = weight row k0 + 8 * i + j
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    else:
        # GEMV: one [BLOCK_K // 8, BLOCK_N] fp32 accumulator per activation row (BLOCK_M <= 4); rows past
        # BLOCK_M are never built.
        row0 = pid_m * BLOCK_M
        x_row = x_ptr + row0 * stride_xm
        acc0 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            words = tl.load(q_cols + (k0 // 8 + offs_w)[:, None] * stride_qk, mask=n_mask[None, :], other=0)
            g = k0 // GROUP_SIZE
            s = tl.load(scales_ptr + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
            # Nibble j = 4 * h + jj of a word, masked in place (no shift for jj) and OR-ed into the bits of 2^23,
            # is the float 2^23 + q * 16^jj (at most 2^23 + 15 * 2^12: still exact); minus 2^23 + z * 16^jj it
            # is (q - z) * 16^jj, exactly. Times x * 16^-jj (exact too) that is x * (q - z): summed over the 8
            # nibbles of a word, then scaled by s once per tile (one FFMA per 8 weights).
            words_hi = words >> 16  # nibbles 4..7 moved to 0..3 (the sign-extended top is masked off below)
            x_ptrs = x_row + (k0 + 8 * offs_w) * stride_xk  # [BLOCK_K // 8]: k = k0 + 8 * i (+ j below)
            part0 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            part1 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            part2 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            part3 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(8):  # jj = j % 4, 16^jj = 1 << (4 * jj)
                if j < 4:
                    q = (words & (0xF << (4 * (j % 4)))) | magic
                else:
                    q = (words_hi & (0xF << (4 * (j % 4)))) | magic
                d = q.to(tl.float32, bitcast=True) - (z * (1 << (4 * (j % 4))) + _TWO_23)[None, :]
                xj = x_ptrs + j * stride_xk
                part0 += d * _x_nibble(xj, row0 < M, j)[:, None]
                if BLOCK_M > 1:
                    part1 += d * _x_nibble(xj + stride_xm, row0 + 1 < M, j)[:, None]
                if BLOCK_M > 2:
                    part2 += d * _x_nibble(xj + 2 * stride_xm, row0 + 2 < M, j)[:, None]
                    part3 += d * _x_nibble(xj + 3 * stride_xm, row0 + 3 < M, j)[:, None]
            acc0 += part0 * s[None, :]
            if BLOCK_M > 1:
                acc1 += part1 * s[None, :]
            if BLOCK_M > 2:
                acc2 += part2 * s[None, :]
                acc3 += part3 * s[None, :]
        rows = offs_m[:, None] - row0  # [BLOCK_M, 1]: 0 .. BLOCK_M - 1
        acc = pick_rows(rows, tl.sum(acc0, axis=0)[None, :], tl.sum(acc1, axis=0)[None, :],
                        tl.sum(acc2, axis=0)[None, :], tl.sum(acc3, axis=0)[None, :], 0.0,
                        BLOCK_M)  # [BLOCK_M, BLOCK_N]
    c_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        acc, is_last = splitk_reduce(acc, offs_m, offs_n, M, N, partial_ptr, count_ptr,
                                     pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT_K)
        c_mask = c_mask & is_last
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=c_mask)


def _block_m(config: TileConfig, m: int) -> int:
    """Rows per program: GEMV 1, 2 or 4; tensor cores ``config.block_m`` or the next power of two >= M (>= 16)."""
    if not config.use_dot:
        return min(4, triton.next_power_of_2(m))
    return config.block_m or max(16, triton.next_power_of_2(m))


def w4a16_linear(
    x: torch.Tensor,  # [num_rows, in_features] bf16 / fp16 / fp32
    qweight: torch.Tensor,  # [in_features // 8, out_features] int32
    scales: torch.Tensor,  # [in_features // group_size, out_features]
    zeros: torch.Tensor,  # [in_features // group_size, out_features]
    bias: torch.Tensor | None = None,  # [out_features]
    split_k: int | None = None,
    block: tuple[int, int, int] | None = None,
    config: TileConfig | None = None,
    counters: torch.Tensor | None = None,  # [>= grid tiles] int32 zeros, for split-K launches
) -> torch.Tensor:  # [num_rows, out_features], x.dtype
    """``x @ W.T + bias`` with W group-wise 4-bit, in one launch. ``config`` defaults to ``W4A16_TILES``'s
    entry for (M, N, K); ``split_k`` and ``block`` (BLOCK_M, BLOCK_N, BLOCK_K; a tensor-core tiling) override
    its fields, for tests. ``counters`` (``triton_splitk.split_counters``): the layer's zeroed arrival counters
    for split-K launches (default: a fresh zeroed buffer)."""
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"x: in_features {k} != 8 * qweight rows {qweight.shape[0]}")
    group_size = k // scales.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or W4A16_TILES.lookup(m, n, k)
    if block is not None:
        cfg = dataclasses.replace(cfg, block_m=block[0], block_n=block[1], block_k=block[2], use_dot=True)
    if split_k is not None:
        cfg = dataclasses.replace(cfg, split_k=split_k)
    block_m, block_n = _block_m(cfg, m), cfg.block_n
    block_k = min(cfg.block_k, group_size)
    grid_m, grid_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    split, k_per_split = split_plan(cfg, k, block_k, grid_m * grid_n, x.device)
    partial, counters = split_buffers(split, m, n, grid_m * grid_n, counters, x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 activations: no TF32 rounding
    _w4a16_kernel[(grid_n, grid_m, split)](
        x, qweight, scales, zeros, scales if bias is None else bias, out, out if partial is None else partial,
        scales if counters is None else counters, m, n, k, k_per_split,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        out.stride(0), out.stride(1), _MAGIC_BITS,
        GROUP_SIZE=group_size, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split, USE_DOT=cfg.use_dot, PRECISION=precision,
        AHEAD=cfg.use_dot and block_m <= OPERANDS_AHEAD_MAX_ROWS,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device),
    )
    return out

