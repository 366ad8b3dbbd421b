"""Triton tensor-core GEMM for 16-bit (bf16 / fp16) weights at verify row counts: ``out = x @ W.T (+ bias)`` for
``x [M, K]`` and ``W [N, K]`` of one 16-bit dtype, fp32 accumulation, output in that dtype or float32 (the LM head).
Opt-in per weight shape: ``layers/linear.dense_linear`` routes M rows of an ``(N, K)`` weight here only where
``quant_tiles.bf16_gemm_config(M, N, K)`` has an entry, i.e. where ``benchmarks/triton_gemm_gpu.py`` measured this
kernel faster than cuBLAS on the GPU; everything else keeps cuBLAS.

Why. A speculative verify step of b requests x (k + 1) tokens multiplies a few hundred rows by every weight
(Llama-3.1-8B at b = 32, k = 7: 256 rows). That is no longer bound by the weights' bytes alone (a 4096 x 4096
projection is 8.6 GFLOP against 34 MB) nor yet a large GEMM, and cuBLAS's heuristics pick tiles that leave much of
an H200 idle on the narrow projections (``benchmarks/results/gemm_backends_gpu.json``: 511 TFLOP/s on the o
projection at M = 256, 585 on qkv, against ~650 on gate_up). Issue 6's bar asks that verify step to cost at most
1.4x the decode step.

Measured on the H200 (``benchmarks/results/triton_gemm_gpu.json``, 34 tile configurations, pointer loads and TMA):
cuBLAS stays faster at M = 256 on every Llama-3.1-8B weight (this kernel's best: x0.87 qkv, x0.96 o, x0.95 gate_up,
x0.90 down, x0.85 LM head) and at M = 128 the kernel wins only on gate_up (x1.04), which moved the verify step by
less than run-to-run noise. So ``BF16_GEMM_TILES`` ships empty and this kernel is a measured opt-in: the table
takes entries for a GPU or a shape where the same benchmark finds a win.

Tried and removed (stop 25, commit e596593): a stream-K schedule (Osama et al., arXiv 2301.03598: one persistent
program per SM, each an equal share of all (tile, K step) iterations, shared tiles reduced by the last program to
arrive), meant to fill the partial last wave cuBLAS leaves at M = 256 (gate_up: 224 tiles of 256 x 128 on 132 SMs),
and gate_up with SiLU-and-multiply fused into that kernel's epilogue. On the H200 both lost to cuBLAS on every
Llama-3.1-8B weight at M = 128 and 256: x0.55-0.97 with an inner K loop per tile segment, x0.32-0.55 with one flat
loop over the program's iterations, and the fused gate_up + SiLU x0.76-0.92 of cuBLAS + the silu kernel
(``benchmarks/results/triton_gemm_streamk_gpu.json``, ``triton_gemm_streamk_flat_gpu.json``).

Design (the classic tiled GEMM; Hopper's wgmma through ``tl.dot``):

- One program per ``BLOCK_M x BLOCK_N`` output tile, looping over K in ``BLOCK_K`` steps with ``num_stages`` loads
  in flight, fp32 accumulator in registers. Programs are numbered row tile fastest within groups of ``GROUP_M``
  row tiles, so the programs that share a weight tile run side by side and all but the first read it from L2: the
  weights (the large operand here) cross HBM once per launch. Worked example, M = 256 rows in BLOCK_M = 128 tiles
  (2 row tiles) and N = 512 in BLOCK_N = 128 (4 column tiles), GROUP_M = 8: program ids 0..7 map to (row tile,
  column tile) = (0,0) (1,0) (0,1) (1,1) (0,2) (1,2) (0,3) (1,3).
- Operand tiles are read either through the tensor memory accelerator (``tma``: host-built tensor descriptors,
  out-of-range rows and columns zero-filled by the hardware) or by pointer loads (row and column indices wrapped
  modulo M and N, so only a ragged K needs a mask). TMA needs 16-byte aligned row strides.
- ``bias`` is added to the fp32 sums; one rounding to the output dtype (none for float32 output).

Programmatic dependent launch (``layers/triton_pdl.py``) as for the other kernels of a step. Tile configurations
come from ``quant_tiles.BF16_GEMM_TILES`` (``TileConfig.block_m``, ``block_n``, ``block_k``, ``num_warps``,
``num_stages``, ``group_m``, ``tma``). Triton is imported by this module only; callers import it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from specserve.layers.quant_tiles import TileConfig, bf16_gemm_config
from specserve.layers.triton_pdl import pdl_args, pdl_begin

GEMM_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _gemm_kernel(
    x_ptr,  # [M, K] 16-bit activations, or a TensorDescriptor of them (block [BLOCK_M, BLOCK_K]) when USE_TMA
    w_ptr,  # [N, K] weights of x's dtype, or a TensorDescriptor of them (block [BLOCK_N, BLOCK_K]) when USE_TMA
    bias_ptr,  # [N] (read only when HAS_BIAS)
    out_ptr,  # [M, N] x's dtype or float32
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    pdl_begin(USE_PDL)
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n  # programs per group of GROUP_M row tiles
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group  # row tile fastest: neighbours share a weight tile
    pid_n = (pid % per_group) // rows_in_group
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        for k0 in range(0, K, BLOCK_K):
            a = x_ptr.load([off_m, k0])  # [BLOCK_M, BLOCK_K], zero past M and K
            b = w_ptr.load([off_n, k0])  # [BLOCK_N, BLOCK_K], zero past N and K
            acc = tl.dot(a, b.T, acc)
    else:
        rows = (off_m + tl.arange(0, BLOCK_M)) % M  # wrapped: a ragged last tile re-reads valid rows, never stored
        cols = (off_n + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk  # [BLOCK_N, BLOCK_K]
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptrs)
                b = tl.load(w_ptrs)
            else:
                k_ok = (k0 + offs_k) < K
                a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            acc = tl.dot(a, b.T, acc)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def gemm_supported(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> bool:
    """Whether ``gemm_linear`` takes these operands: 2D x and weight of one 16-bit dtype and device, matching
    in_features, a 1D bias (if any) of that dtype."""
    return (x.dim() == 2 and weight.dim() == 2 and weight.dtype in GEMM_DTYPES and x.dtype == weight.dtype
            and x.device == weight.device and x.shape[1] == weight.shape[1]
            and (bias is None or (bias.dtype == weight.dtype and bias.dim() == 1)))


def _tma_ok(t: torch.Tensor) -> bool:  # [rows, cols]: unit inner stride, 16-byte aligned base and row stride
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def gemm_linear(
    x: torch.Tensor,  # [num_rows, in_features] bf16 / fp16
    weight: torch.Tensor,  # [out_features, in_features], x.dtype
    bias: torch.Tensor | None = None,  # [out_features], x.dtype
    config: TileConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [num_rows, out_features], out_dtype (default x.dtype)
    """``F.linear(x, weight, bias)`` in one launch with fp32 sums (up to summation order; bias added in fp32, one
    rounding to ``out_dtype``; ``torch.float32`` keeps the sums unrounded). ``config`` defaults to
    ``quant_tiles.bf16_gemm_config(M, N, K)`` (a ``ValueError`` when the table has none for this shape); its
    ``tma`` is honoured only where both operands are TMA-aligned, else the pointer path runs."""
    m, k = x.shape
    n = weight.shape[0]
    if not gemm_supported(x, weight, bias):
        raise ValueError(f"gemm_linear takes 2D bf16 / fp16 x and weight of one dtype with matching in_features, "
                         f"got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    cfg = config or bf16_gemm_config(m, n, k)
    if cfg is None:
        raise ValueError(f"no BF16_GEMM_TILES entry for M={m}, N={n}, K={k}")
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    block_m, block_n = cfg.block_m or 128, cfg.block_n
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    use_tma = cfg.tma and _tma_ok(x) and _tma_ok(weight)
    if use_tma:
        xs = TensorDescriptor(x, shape=[m, k], strides=[x.stride(0), 1], block_shape=[block_m, block_k])
        ws = TensorDescriptor(weight, shape=[n, k], strides=[weight.stride(0), 1], block_shape=[block_n, block_k])
    else:
        xs, ws = x, weight
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](
        xs, ws, weight if bias is None else bias, out,
        m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        EVEN_K=k % block_k == 0, USE_TMA=use_tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device),
    )
    return out
