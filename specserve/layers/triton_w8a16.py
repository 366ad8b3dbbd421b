"""Triton kernels for FP8 (e4m3) projections (Micikevicius et al., "FP8 Formats for Deep Learning", arXiv
2209.05433; formats and the plain-torch maths in ``layers/quant_gpu.py``):

1. ``w8a16_linear``: ``out = (x_q @ w_q.T) * x_scale * w_scale (+ bias)`` with e4m3 weights ``[N, K]``
   (row-major, one fp32 scale per output channel) and activations quantized per token, by default by the fused
   quantizer (2. below) before the launch (``act_quant="per_token_prequant"``; on an H200 that beat quantizing
   inside the kernel at every row count, ``quant_tiles.W8A16_INKERNEL_QUANT_MAX_ROWS``), or inside the kernel:
   ``x_scale = max(amax(|x|) / 448, 1e-12)``, ``x_q = e4m3(clamp(x / x_scale, -448, 448))`` with IEEE division
   and round-to-nearest-even, the very operations of the fused quantizer (2. below; shared ``@triton.jit``
   helpers, the same ``cvt.rn.satfinite.e4m3x2.f32``), so ``x_q`` and ``x_scale`` are bit for bit what the
   _scaled_mm path quantizes. Every product of two e4m3 values is exact in fp32 (and in the fp16 MMA), so the
   kernel computes ``fp8_linear_reference`` (``quant_gpu.py``) up to fp32 summation order, for every row
   count: a token's output does not depend on the batch it shares a step with (decode at batch b vs a
   speculative verify of b x (k + 1) rows) beyond summation order. The one exception is the fp8 MMA
   (``fp8_dot``, the default tiles up to 32 rows): on Hopper its running sum over each 32 products keeps fewer
   bits than fp32 (about 14, DeepSeek-V3 report, arXiv 2412.19437, section 3.3.2) before it is added into fp32,
   so there a row differs from the other paths by up to about 2^-14 of the sum's magnitude instead. One launch
   per projection, for the small row counts of decoding (M of 1 to a few dozen), where a GEMM is bound by the bytes
   of weight it streams. Two other activation modes (``act_quant``): ``"per_token_prequant"`` (the same maths, the
   activations quantized by 2. first: one more launch, half the activation bytes, no per-program amax pass) and
   ``"none"`` (activations not quantized: ``w8a16_linear_reference``, the maths of the kernel before the per-token
   mode).
2. ``quantize_fp8_rows_triton``: per-row (per-token) quantization of activations for ``torch._scaled_mm`` at
   larger M, one kernel instead of torch's eight (float, abs, amax, div, clamp, div, clamp, to), with
   ``quantize_fp8_rows``'s exact numerics (IEEE division, round to nearest even).

W8A16 design. Output channels are tiled by ``BLOCK_N``; a program streams its ``BLOCK_N x K`` slab of weights
(``BLOCK_K`` bytes contiguous per row per step) and keeps all M rows of activations of the launch (``BLOCK_M``
>= M), so every weight byte is read once. Three ways to multiply, chosen per row bucket in
``layers/quant_tiles.py`` (the default tables use the fp8 MMA up to 32 rows and the fp16 MMA above; the GEMV
serves tables that ask for it, e.g. an ``override`` in a benchmark):

- GEMV (``use_dot=False``, M of 1 to 4): fp32 FMAs on the CUDA cores into one ``[BLOCK_N, BLOCK_K]``
  accumulator per row, summed over K once at the end; the weight tile stays in the registers it was loaded into
  (16-byte loads, 16 weights each). e4m3 -> fp32 is two cheap conversions on sm_89+ (e4m3x2 -> f16x2 for a pair,
  f16 -> f32), about 3.5 instructions per weight in all at M = 1 (sm_90 SASS). The tensor cores would need 16
  rows (15 of them padding) and the weight tile shuffled through shared memory.
- tensor cores (``use_dot=True``): the swapped product ``out.T = W @ x.T`` so the output channels sit on the
  MMA's M side (>= 16 or 64) and the few activation rows on its N side; the weight tile (and the quantized
  activation tile) is converted to fp16 in registers (the activation dtype in mode "none"). Triton pipelines
  these loads (``num_stages``) through shared memory. With e4m3 activations (mode 2) and ``fp8_dot``, the MMA
  takes both e4m3 tiles as they are: no conversion, and the weight tiles go from global to shared memory to the
  tensor cores without passing through the registers, so many stages of them can be in flight at M = 1. Products
  of two e4m3 values are exact; the MMA's own running sum keeps fewer bits than fp32, so Triton adds it into the
  fp32 accumulator every 32 of K (``FP8_PRECISE_EVERY``). On the H200 its error against the fp64 reference equals
  the GEMV's to three digits (bf16 output rounding dominates; ``benchmarks/results/quant_gemm_fp8dot_gpu.json``).

In-kernel activation quantization: before its main loop, each program reads all of K of its activation rows
once (from L2: x is tiny next to the weights) for the row amax, hence the scale; the main loop then quantizes
each activation chunk in registers (``x / scale`` -> e4m3 -> fp32 for the GEMV's FMAs, fp16 for the MMA) and the
epilogue multiplies the fp32 sums by ``x_scale`` and ``w_scale``. With split K every split program does the
full-K amax pass (the scale must be known before the first chunk): measured slower than the pre-quantized mode
at every M (``benchmarks/results/quant_gemm_gpu_nosweep.json``), which is therefore the default.

With few output tiles, K can be split (``split_k``) and the partial sums are reduced inside the same launch
(``layers/triton_splitk.py``): no zeroing kernel, no separate reduction kernel, deterministic.

Triton is imported by this module only; callers import it lazily on the CUDA path (or in tests under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.layers.quant_tiles import W8A16_TILES, TileConfig
from specserve.layers.triton_pdl import pdl_args, pdl_begin
from specserve.layers.triton_splitk import pick_rows, split_buffers, split_plan, splitk_reduce

FP8_MAX = tl.constexpr(448.0)  # largest finite e4m3fn value (quant_gpu.FP8_MAX)
# An fp8 MMA on Hopper keeps fewer mantissa bits in its running sum than fp32 (DeepSeek-V3 report, arXiv
# 2412.19437, section 3.3.2); Triton adds its partial sums into an fp32 accumulator every this many K elements.
FP8_PRECISE_EVERY = tl.constexpr(32)
_MIN_SCALE = tl.constexpr(1e-12)  # quant_gpu._MIN_SCALE: an all-zero row gets this scale
ACT_QUANT_MODES = {"none": 0, "per_token": 1, "per_token_prequant": 2}  # -> the kernel's X_MODE


# ---- per-token FP8 maths shared by both kernels (same operations, so the same bits) ---------------------------
@triton.jit
def _fp8_scale(amax):
    """A row's scale from its fp32 amax: ``max(amax / 448, 1e-12)``, IEEE division."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX), _MIN_SCALE)


@triton.jit
def _fp8_quantize(xf, scale):
    """fp32 values -> e4m3: ``e4m3(clamp(x / scale, -448, 448))``, IEEE division, round to nearest even."""
    return tl.clamp(tl.math.div_rn(xf, scale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _row_scale(x_row, K, stride_xk, valid, BLOCK: tl.constexpr):
    """``_fp8_scale`` of one row of ``K`` activations (all of K, whatever split this program works on); a row
    that is not ``valid`` reads as zeros. The chunks load in their own (undistributed) layout."""
    offs = tl.arange(0, BLOCK)
    running = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        xs = tl.load(x_row + (k0 + offs) * stride_xk, mask=(k0 + offs < K) & valid, other=0.0).to(tl.float32)
        running = tl.maximum(running, tl.abs(xs))
    return _fp8_scale(tl.max(running, axis=0))


@triton.jit
def _gemv_x(x_ptrs, mask, scale, X_MODE: tl.constexpr):
    """One activation chunk of the GEMV as fp32: as stored (X_MODE 0), quantized with the row's ``scale`` and
    dequantized without it (1: exact, e4m3 -> fp32), or already e4m3 (2)."""
    xs = tl.load(x_ptrs, mask=mask, other=0.0)
    if X_MODE == 1:
        xs = _fp8_quantize(xs.to(tl.float32), scale)
    return xs.to(tl.float32)


@triton.jit
def _gemv_scale(x_row, x_scale_ptr, row, M, K, stride_xk, BLOCK: tl.constexpr, X_MODE: tl.constexpr):
    """The per-token scale of GEMV row ``row``: computed from the row (X_MODE 1), read (2), or 1 (0)."""
    if X_MODE == 1:
        s = _row_scale(x_row, K, stride_xk, row < M, BLOCK)
    elif X_MODE == 2:
        s = tl.load(x_scale_ptr + row, mask=row < M, other=1.0)
    else:
        s = 1.0
    return s


@triton.jit
def _dot_tile(
    w,  # [BLOCK_N, BLOCK_K] float8_e4m3fn weight tile
    xt,  # [BLOCK_K, BLOCK_M] activation tile, transposed: 16-bit / fp32 (X_MODE 0, 1) or e4m3 (2)
    acc_t,  # [BLOCK_N, BLOCK_M] fp32 running sums
    x_scale,  # [BLOCK_M] per-token scales (X_MODE 1; unread otherwise)
    X_MODE: tl.constexpr, FP8_DOT: tl.constexpr, W_VIA_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    """``acc_t + w @ xt`` on the tensor cores, one K tile of the W8A16 kernel's swapped product."""
    if X_MODE == 0:
        if W_VIA_F32:  # bf16: e4m3x2 -> f16x2 -> f32 -> bf16x2 (packed), cheaper than e4m3 -> f16 -> bf16
            w = w.to(tl.float32)
        acc_t = tl.dot(w.to(xt.dtype), xt, acc_t, input_precision=PRECISION)  # exact conversions
    elif FP8_DOT:  # e4m3 x e4m3 on the tensor cores (X_MODE 2): exact products, fp32 sums promoted
        acc_t = tl.dot(w, xt, acc_t, max_num_imprecise_acc=FP8_PRECISE_EVERY)  # every 32 of K
    else:
        if X_MODE == 1:
            xt = _fp8_quantize(xt.to(tl.float32), x_scale[None, :])
        # e4m3 -> fp16 is exact (one cvt per pair) and so is every fp16 x fp16 product in fp32
        acc_t = tl.dot(w.to(tl.float16), xt.to(tl.float16), acc_t)
    return acc_t


@triton.jit
def _w8a16_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32 activations (X_MODE 0, 1), or float8_e4m3fn quantized ones (X_MODE 2)
    w_ptr,  # [N, K] float8_e4m3fn weights, one row per output channel
    w_scale_ptr,  # [N] fp32 per-output-channel scales
    x_scale_ptr,  # [M] fp32 per-token scales of the quantized activations (read when X_MODE == 2)
    bias_ptr,  # [N] (read only when HAS_BIAS)
    out_ptr,  # [M, N] activation dtype
    partial_ptr,  # [SPLIT_K, M, N] fp32 partial sums (SPLIT_K > 1 only)
    count_ptr,  # [grid_m * grid_n] int32 arrival counters (SPLIT_K > 1 only)
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, W_VIA_F32: tl.constexpr,
    PRECISION: tl.constexpr, X_MODE: tl.constexpr, FP8_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
    PREFETCH: tl.constexpr = 0,  # weight tiles loaded before the PDL wait (tensor-core path; 0..2)
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_kb = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1] row starts
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # k_per_split is a multiple of BLOCK_K: no tile straddles splits
    if USE_DOT and PREFETCH > 0:
        # The first PREFETCH weight tiles of this program's K range, loaded before the wait below: weights are
        # never written by a kernel of the step, so their loads may overlap the kernel before this one.
        k_pre = k_lo + offs_kb  # [BLOCK_K]
        w_pre0 = tl.load(w_rows + k_pre[None, :] * stride_wk, mask=n_mask[:, None] & (k_pre < k_hi)[None, :],
                         other=0.0)
        w_pre1 = w_pre0
        if PREFETCH > 1:
            w_pre1 = tl.load(w_rows + (k_pre + BLOCK_K)[None, :] * stride_wk,
                             mask=n_mask[:, None] & (k_pre + BLOCK_K < k_hi)[None, :], other=0.0)
    pdl_begin(USE_PDL)
    if USE_DOT:
        # out.T [BLOCK_N, BLOCK_M] = W [BLOCK_N, K] @ x.T [K, BLOCK_M]: channels on the MMA's M side
        x_cols = x_ptr + offs_m[None, :] * stride_xm  # [1, BLOCK_M]
        x_scale = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)  # per-token scales: X_MODE 1 and 2 set them
        if X_MODE == 1:  # per-token scales over all of K (x is small and read from L2), before the main loop
            running = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + offs_kb
                xt = tl.load(x_cols + offs_k[:, None] * stride_xk, mask=m_mask[None, :] & (offs_k < K)[:, None],
                             other=0.0)
                running = tl.maximum(running, tl.abs(xt.to(tl.float32)))
            x_scale = _fp8_scale(tl.max(running, axis=0))  # [BLOCK_M]
        elif X_MODE == 2:
            x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=1.0)
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if PREFETCH > 0:  # the prefetched tiles' activations, loaded now and multiplied after the loop
            x_pre0 = tl.load(x_cols + k_pre[:, None] * stride_xk, mask=m_mask[None, :] & (k_pre < k_hi)[:, None],
                             other=0.0)  # [BLOCK_K, BLOCK_M]
            x_pre1 = x_pre0
            if PREFETCH > 1:
                x_pre1 = tl.load(x_cols + (k_pre + BLOCK_K)[:, None] * stride_xk,
                                 mask=m_mask[None, :] & (k_pre + BLOCK_K < k_hi)[:, None], other=0.0)
        for k0 in range(k_lo + PREFETCH * BLOCK_K, k_hi, BLOCK_K):
            offs_k = k0 + offs_kb
            k_mask = offs_k < K
            w_ptrs = w_rows + offs_k[None, :] * stride_wk
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xt = tl.load(x_cols + offs_k[:, None] * stride_xk, mask=m_mask[None, :] & k_mask[:, None],
                         other=0.0)  # [BLOCK_K, BLOCK_M]
            acc_t = _dot_tile(w, xt, acc_t, x_scale, X_MODE, FP8_DOT, W_VIA_F32, PRECISION)
        if PREFETCH > 0:  # zeros past k_hi add nothing
            acc_t = _dot_tile(w_pre0, x_pre0, acc_t, x_scale, X_MODE, FP8_DOT, W_VIA_F32, PRECISION)
            if PREFETCH > 1:
                acc_t = _dot_tile(w_pre1, x_pre1, acc_t, x_scale, X_MODE, FP8_DOT, W_VIA_F32, PRECISION)
        acc = tl.trans(acc_t)  # [BLOCK_M, BLOCK_N]
        if X_MODE != 0:
            xs_col = x_scale[:, None]  # [BLOCK_M, 1]
    else:
        # GEMV on the CUDA cores: one [BLOCK_N, BLOCK_K] fp32 accumulator per activation row (BLOCK_M <= 4),
        # acc_r[n, k'] summing x[r, k] * w[n, k] over k = k' (mod BLOCK_K), reduced over k' once at the end. 2D
        # tensors keep the weight tile in the layout it was loaded in (a 3D [M, N, K] accumulator makes Triton
        # shuffle every weight tile through shared memory); accumulators of rows >= BLOCK_M are never built.
        row0 = pid_m * BLOCK_M
        x_row = x_ptr + row0 * stride_xm
        s0 = _gemv_scale(x_row, x_scale_ptr, row0, M, K, stride_xk, BLOCK_K, X_MODE)
        s1 = s0
        s2 = s0
        s3 = s0
        if BLOCK_M > 1:
            s1 = _gemv_scale(x_row + stride_xm, x_scale_ptr, row0 + 1, M, K, stride_xk, BLOCK_K, X_MODE)
        if BLOCK_M > 2:
            s2 = _gemv_scale(x_row + 2 * stride_xm, x_scale_ptr, row0 + 2, M, K, stride_xk, BLOCK_K, X_MODE)
            s3 = _gemv_scale(x_row + 3 * stride_xm, x_scale_ptr, row0 + 3, M, K, stride_xk, BLOCK_K, X_MODE)
        acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + offs_kb
            k_mask = offs_k < K
            w_ptrs = w_rows + offs_k[None, :] * stride_wk
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            w = w.to(tl.float32)  # e4m3x2 -> f16x2 -> f32: exact
            x_ptrs = x_row + offs_k * stride_xk
            acc0 += w * _gemv_x(x_ptrs, k_mask & (row0 < M), s0, X_MODE)[None, :]
            if BLOCK_M > 1:
                acc1 += w * _gemv_x(x_ptrs + stride_xm, k_mask & (row0 + 1 < M), s1, X_MODE)[None, :]
            if BLOCK_M > 2:
                acc2 += w * _gemv_x(x_ptrs + 2 * stride_xm, k_mask & (row0 + 2 < M), s2, X_MODE)[None, :]
                acc3 += w * _gemv_x(x_ptrs + 3 * stride_xm, k_mask & (row0 + 3 < M), s3, X_MODE)[None, :]
        rows = offs_m[:, None] - row0  # [BLOCK_M, 1]: 0 .. BLOCK_M - 1
        acc = pick_rows(rows, tl.sum(acc0, axis=1)[None, :], tl.sum(acc1, axis=1)[None, :],
                        tl.sum(acc2, axis=1)[None, :], tl.sum(acc3, axis=1)[None, :], 0.0,
                        BLOCK_M)  # [BLOCK_M, BLOCK_N]
        xs_col = pick_rows(rows, s0, s1, s2, s3, 1.0, BLOCK_M)  # [BLOCK_M, 1] per-token scales (X_MODE != 0)
    c_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        acc, is_last = splitk_reduce(acc, offs_m, offs_n, M, N, partial_ptr, count_ptr,
                                     pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT_K)
        c_mask = c_mask & is_last
    scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    if X_MODE != 0:  # (sum_k x_q w_q) * x_scale * w_scale, as fp8_linear_reference multiplies
        acc = acc * xs_col
    out = acc * scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=c_mask)


def _block_m(config: TileConfig, m: int) -> int:
    """Rows per program: the tensor-core path takes at least 16 (and ``config.block_m`` if set); the GEMV path
    1, 2 or 4 (more rows run in several row tiles, each reading the weights again)."""
    if not config.use_dot:
        return min(4, triton.next_power_of_2(m))
    return config.block_m or max(16, triton.next_power_of_2(m))


def w8a16_linear(
    x: torch.Tensor,  # [num_rows, in_features] bf16 / fp16 / fp32
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    weight_scale: torch.Tensor,  # [1, out_features] (or [out_features]) float32
    bias: torch.Tensor | None = None,  # [out_features]
    config: TileConfig | None = None,
    counters: torch.Tensor | None = None,  # [>= grid tiles] int32 zeros, for split-K launches
    act_quant: str = "per_token",
    x_scale: torch.Tensor | None = None,  # [num_rows, 1] fp32: x is already e4m3 (quantize_fp8_rows' bits)
    out_dtype: torch.dtype | None = None,  # the output dtype (default x.dtype; required with x_scale)
) -> torch.Tensor:  # [num_rows, out_features], out_dtype
    """``fp8_linear_reference``'s maths in one launch: activations quantized per token inside the kernel
    (``act_quant="per_token"``, the same e4m3 bits as ``quantize_fp8_rows``), fp32 sums, then ``* x_scale *
    weight_scale + bias``. ``"per_token_prequant"``: the same maths with the activations quantized by
    ``quantize_fp8_rows_triton`` first (one more launch, half the activation bytes in the GEMM). ``"none"``:
    activations not quantized (``w8a16_linear_reference``; results then depend on the row count's path).
    ``config`` defaults to ``W8A16_TILES``'s entry for (M, N, K); ``counters`` (see ``split_counters``) to a
    fresh zeroed buffer when the configuration splits K. ``x_scale``: ``x`` is already quantized (e4m3, e.g. by
    a producer op that fused the quantizer, ``TritonOps.rms_norm_fp8``): the ``"per_token_prequant"`` launch
    without its quantizer, writing ``out_dtype``."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x: in_features {k} != weight in_features {weight.shape[1]}")
    if act_quant not in ACT_QUANT_MODES:
        raise ValueError(f"act_quant: {act_quant!r} is not one of {sorted(ACT_QUANT_MODES)}")
    x_mode = ACT_QUANT_MODES[act_quant]
    if x_scale is not None:
        if act_quant != "per_token_prequant" or x.dtype != torch.float8_e4m3fn or out_dtype is None:
            raise ValueError("x_scale: needs act_quant='per_token_prequant', e4m3 x and out_dtype")
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or W8A16_TILES.lookup(m, n, k)
    block_m, block_n = _block_m(cfg, m), cfg.block_n
    fp8_dot = cfg.use_dot and cfg.fp8_dot and x_mode == 2
    block_k = min(cfg.block_k, max(32 if fp8_dot else 16, triton.next_power_of_2(k)))  # an fp8 MMA takes 32 of K
    grid_m, grid_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    split, k_per_split = split_plan(cfg, k, block_k, grid_m * grid_n, x.device)
    partial, counters = split_buffers(split, m, n, grid_m * grid_n, counters, x.device)
    w_scale = weight_scale.reshape(-1)
    if not w_scale.is_contiguous():
        w_scale = w_scale.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 activations: no TF32 rounding (X_MODE 0)
    bf16_x = x.dtype == torch.bfloat16
    if x_scale is None:
        x_scale = w_scale  # unread unless X_MODE 2
        if x_mode == 2:
            x, x_scale = quantize_fp8_rows_triton(x)  # [M, K] e4m3, [M, 1] fp32
    _w8a16_kernel[(grid_n, grid_m, split)](
        x, weight, w_scale, x_scale, w_scale if bias is None else bias, out,
        out if partial is None else partial, w_scale if counters is None else counters,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        USE_DOT=cfg.use_dot, EVEN_K=k % block_k == 0, W_VIA_F32=bf16_x and x_mode == 0, PRECISION=precision,
        X_MODE=x_mode, FP8_DOT=fp8_dot, PREFETCH=cfg.prefetch if cfg.use_dot else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device),
    )
    return out


# ---- per-token activation quantization (the _scaled_mm path) --------------------------------------------------
@triton.jit
def _quantize_fp8_rows_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32
    q_ptr,  # [M, K] float8_e4m3fn, contiguous
    scale_ptr,  # [M] fp32 (the [M, 1] scale column)
    K, stride_xm, stride_xk,
    BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    """One program per row: ``scale = max(amax(|x|) / 448, 1e-12)``, ``q = e4m3(clamp(x / scale, -448, 448))``
    with IEEE division and round-to-nearest-even, as ``quantize_fp8_rows``. ``ONE_PASS``: the row fits one
    tile and stays in registers; otherwise a first pass finds amax and a second re-reads the row (from L2)."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * K
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:
        xf = tl.load(x_row + offs * stride_xk, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(xf), axis=0)
    else:
        running = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xs = tl.load(x_row + (k0 + offs) * stride_xk, mask=k0 + offs < K, other=0.0).to(tl.float32)
            running = tl.maximum(running, tl.abs(xs))
        amax = tl.max(running, axis=0)
    scale = _fp8_scale(amax)
    tl.store(scale_ptr + row, scale)
    if ONE_PASS:
        tl.store(q_row + offs, _fp8_quantize(xf, scale), mask=offs < K)
    else:
        for k0 in range(0, K, BLOCK_K):
            xs = tl.load(x_row + (k0 + offs) * stride_xk, mask=k0 + offs < K, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs, _fp8_quantize(xs, scale), mask=k0 + offs < K)


def quantize_fp8_rows_triton(
    x: torch.Tensor,  # [num_rows, num_cols] bf16 / fp16 / fp32
    max_block: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor]:  # (x_q [num_rows, num_cols] float8_e4m3fn, scale [num_rows, 1] fp32)
    """``quantize_fp8_rows`` in one launch (same bits). Rows up to ``max_block`` columns are read once."""
    m, k = x.shape
    x_q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return x_q, scale
    block = min(triton.next_power_of_2(max(k, 16)), max_block)
    num_warps = 4 if block <= 2048 else 8 if block <= 4096 else 16
    _quantize_fp8_rows_kernel[(m,)](x, x_q, scale, k, x.stride(0), x.stride(1), BLOCK_K=block,
                                    ONE_PASS=block >= k, num_warps=num_warps, **pdl_args(x.device))
    return x_q, scale
