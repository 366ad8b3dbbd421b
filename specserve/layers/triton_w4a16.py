"""Triton W4A16 GEMM: ``out = x @ dequant(qweight, scales, zeros).T`` with 4-bit group-wise weights (AWQ-style
asymmetric groups, Lin et al., arXiv 2306.00978) and 16-bit (or fp32) activations. Layout and quantization
formula: ``layers/quant_gpu.py``.

One program computes a ``[BLOCK_M, BLOCK_N]`` output tile over ``tiles_per_split`` K tiles. Each K tile lies in
one quantization group (``BLOCK_K`` divides ``group_size``), so it needs one row of scales and zeros. The weight
tile is loaded as the int32 words that hold it (word ``k // 8`` for row ``k``; the 8 rows of a word hit the same
cache line), shifted and masked to 4-bit values, dequantized in fp32 registers, rounded to the activation dtype
and fed to ``tl.dot`` with an fp32 accumulator.

Decoding (M of 1 to a few dozen) reads every weight once and is bound by memory bandwidth; with few M tiles
the N tiles alone would leave most SMs idle, so K is split across programs (``SPLIT_K``) that write fp32
partial sums, added by one ``sum`` afterwards (deterministic: no atomics). Large M (prefill) uses larger tiles
and no split.

Triton is imported by this module only; callers import it lazily on the CUDA path (or in tests under
``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _w4a16_kernel(
    x_ptr,  # [M, K] activations
    qweight_ptr,  # [K // 8, N] int32
    scales_ptr,  # [K // GROUP_SIZE, N]
    zeros_ptr,  # [K // GROUP_SIZE, N]
    out_ptr,  # [SPLIT_K, M, N] (fp32 partial sums) or [M, N] (activation dtype) when SPLIT_K == 1
    M, N, K, tiles_per_split,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_os, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    shifts = (tl.arange(0, BLOCK_K) % 8) * 4  # bit offset of row k inside its int32 word
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, tiles_per_split):
        k0 = (pid_k * tiles_per_split + t) * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K  # all or nothing: K is a multiple of BLOCK_K; false past the end of the last split
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        words = tl.load(qweight_ptr + (offs_k[:, None] // 8) * stride_qk + offs_n[None, :] * stride_qn,
                        mask=k_mask[:, None] & n_mask[None, :], other=0)
        q = (words >> shifts[:, None]) & 0xF  # [BLOCK_K, BLOCK_N] in [0, 15]
        g = k0 // GROUP_SIZE
        gn_mask = n_mask & (k0 < K)
        s = tl.load(scales_ptr + g * stride_sg + offs_n * stride_sn, mask=gn_mask, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + g * stride_sg + offs_n * stride_sn, mask=gn_mask, other=0.0).to(tl.float32)
        w = ((q.to(tl.float32) - z[None, :]) * s[None, :]).to(a.dtype)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _tile_config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by row count: small M is a bandwidth-bound GEMV
    (thin tiles, long K tiles), large M a compute-bound GEMM (square tiles)."""
    if m <= 16:
        return 16, 64, 128, 4, 4
    if m <= 64:
        return 32 if m <= 32 else 64, 64, 64, 4, 4
    if m <= 256:
        return 64, 128, 64, 4, 3
    return 128, 128, 64, 8, 3


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cpu":
        return 4  # the interpreter: a few splits still exercise the split-K path
    return torch.cuda.get_device_properties(device).multi_processor_count


def w4a16_linear(
    x: torch.Tensor,  # [num_rows, in_features] bf16 / fp16 / fp32
    qweight: torch.Tensor,  # [in_features // 8, out_features] int32
    scales: torch.Tensor,  # [in_features // group_size, out_features]
    zeros: torch.Tensor,  # [in_features // group_size, out_features]
    bias: torch.Tensor | None = None,  # [out_features]
    split_k: int | None = None,
    block: tuple[int, int, int] | None = None,
) -> torch.Tensor:  # [num_rows, out_features], x.dtype
    """``x @ W.T`` with W group-wise 4-bit. ``split_k`` (default: enough programs for two waves of the SMs) and
    ``block`` (BLOCK_M, BLOCK_N, BLOCK_K) override the heuristics, for tests."""
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"x: in_features {k} != 8 * qweight rows {qweight.shape[0]}")
    group_size = k // scales.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = _tile_config(m)
    if block is not None:
        block_m, block_n, block_k = block
    block_k = min(block_k, group_size)
    grid_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    num_k_tiles = k // block_k
    if split_k is None:
        split_k = 1 if m > 64 else max(1, min(num_k_tiles // 2, triton.cdiv(2 * _num_sms(x.device), grid_mn)))
    tiles_per_split = triton.cdiv(num_k_tiles, max(1, split_k))
    split_k = triton.cdiv(num_k_tiles, tiles_per_split)
    target = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    stride_os = 0 if split_k == 1 else target.stride(0)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 activations: no TF32 rounding
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _w4a16_kernel[grid](
        x, qweight, scales, zeros, target, m, n, k, tiles_per_split,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        stride_os, target.stride(-2), target.stride(-1),
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split_k > 1:
        out = target.sum(dim=0).to(x.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
