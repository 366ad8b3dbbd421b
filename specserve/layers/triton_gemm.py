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

Stream-K schedule (``TileConfig.stream_k``; Osama et al., "Stream-K: Work-centric Parallel Decomposition for Dense
Matrix-Matrix Multiplication on the GPU", arXiv 2301.03598). With one program per tile, a GEMM whose tiles do not
fill a whole number of waves leaves SMs idle for the last wave: at M = 256, Llama-3.1-8B's gate_up is 224 tiles of
256 x 128 on 132 SMs (1.7 waves: 85% busy), qkv 96 and o 64 tiles of 128 x 128 (one wave, 73% / 48% busy).
Stream-K launches one persistent program per SM instead and gives each an equal share of all
``num_tiles * iters`` (output tile, K step) iterations, in tile order, tiles numbered row tile fastest (programs
side by side then read the same weight tile, once from HBM). Worked example: 3 tiles of 4 K steps (12 iterations)
on 5 programs: program p takes iterations [12p // 5, 12(p + 1) // 5) = [0, 2) [2, 4) [4, 7) [7, 9) [9, 12):

    tile 0 = iterations 0..3:  p0 (K steps 0-1), p1 (2-3)
    tile 1 = iterations 4..7:  p2 (0-2), p3 (3)
    tile 2 = iterations 8..11: p3 (0), p4 (1-3)

A tile covered by one program is stored directly. A shared tile: each contributor stores its fp32 partial in its
own workspace slot (slot 0 for the segment its range starts inside, 1 for the segment it ends in: at most one of
each), then counts its arrival on the tile's counter (``triton_splitk``'s pattern: CTA barrier, acq_rel atomic);
the last to arrive adds the partials of contributors ``first .. last`` in that order (deterministic whatever the
arrival order; the owner of iteration i is ``((i + 1) * P - 1) // total``), resets the counter and stores the
tile. No program waits on another, so nothing assumes they are all resident at once.

Programmatic dependent launch (``layers/triton_pdl.py``) as for the other kernels of a step. Tile configurations
come from ``quant_tiles.BF16_GEMM_TILES`` (``TileConfig.block_m``, ``block_n``, ``block_k``, ``num_warps``,
``num_stages``, ``group_m``, ``tma``, ``stream_k``). Triton is imported by this module only; callers import it
lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from specserve.layers.quant_tiles import TileConfig, bf16_gemm_config
from specserve.layers.triton_pdl import pdl_args, pdl_begin
from specserve.layers.triton_splitk import num_sms

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


@triton.jit
def _streamk_kernel(
    x_ptr,  # [M, K] 16-bit activations, or a TensorDescriptor of them (block [BLOCK_M, BLOCK_K]) when USE_TMA
    w_ptr,  # [N, K] weights of x's dtype, or a TensorDescriptor of them (block [BLOCK_N, BLOCK_K]) when USE_TMA
    bias_ptr,  # [N] (read only when HAS_BIAS)
    out_ptr,  # [M, N] x's dtype or float32
    partial_ptr,  # [num_programs, 2, PARTS, BLOCK_M, BLOCK_N] fp32: each program's head (0) and tail (1) partials
    count_ptr,  # [>= num_tiles] int32 arrival counters, zero before and after the launch
    M, N, K,  # SWIGLU: N = intermediate size (w has 2N rows: gate rows 0..N-1, up rows N..2N-1; out has N columns)
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    SWIGLU: tl.constexpr,  # out = silu(x @ gate.T) * (x @ up.T), each sum rounded to out's dtype first
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    pdl_begin(USE_PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    iters = tl.cdiv(K, BLOCK_K)  # K steps per tile
    total = grid_m * tl.cdiv(N, BLOCK_N) * iters
    start = pid * total // programs  # this program's iterations: [start, end)
    end = (pid + 1) * total // programs
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    tile_elems = BLOCK_M * BLOCK_N
    PARTS: tl.constexpr = 2 if SWIGLU else 1  # accumulators per tile (gate and up)
    ws = partial_ptr + rm[:, None] * BLOCK_N + rn[None, :]  # [BLOCK_M, BLOCK_N] offsets within a workspace slot
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SWIGLU only (dead code otherwise)
    # One flat loop over this program's iterations (tile changes inside it), so that the compiler's software
    # pipelining keeps loads in flight across tile boundaries too; a segment's epilogue runs at its last iteration.
    for it in range(start, end):
        tile = it // iters
        ki = it - tile * iters
        off_m = (tile % grid_m) * BLOCK_M  # row tile fastest
        off_n = (tile // grid_m) * BLOCK_N
        if USE_TMA:
            a = x_ptr.load([off_m, ki * BLOCK_K])  # [BLOCK_M, BLOCK_K], zero past M and K
            b = w_ptr.load([off_n, ki * BLOCK_K])  # [BLOCK_N, BLOCK_K], zero past the weight's rows and K
            if SWIGLU:
                acc_up = tl.dot(a, w_ptr.load([N + off_n, ki * BLOCK_K]).T, acc_up)
        else:
            rows = (off_m + rm) % M  # wrapped: a ragged last tile re-reads valid rows, never stored
            cols = (off_n + rn) % N
            k_ok = (ki * BLOCK_K + offs_k) < K
            x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + (ki * BLOCK_K + offs_k)[None, :] * stride_xk
            w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + (ki * BLOCK_K + offs_k)[None, :] * stride_wk
            if EVEN_K:
                a = tl.load(x_ptrs)  # [BLOCK_M, BLOCK_K]
                b = tl.load(w_ptrs)  # [BLOCK_N, BLOCK_K]
                if SWIGLU:
                    acc_up = tl.dot(a, tl.load(w_ptrs + N * stride_wn).T, acc_up)
            else:
                a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                if SWIGLU:
                    acc_up = tl.dot(a, tl.load(w_ptrs + N * stride_wn, mask=k_ok[None, :], other=0.0).T, acc_up)
        acc = tl.dot(a, b.T, acc)
        if (ki == iters - 1) | (it == end - 1):  # the end of this program's segment of the tile
            tile_start = tile * iters
            owns = (start <= tile_start) & (ki == iters - 1)  # the whole tile was this program's: store it
            if not owns:
                # contributors first .. last; a contributor's slot: 0 if its range starts inside this tile, else 1
                first = ((tile_start + 1) * programs - 1) // total
                last = ((tile_start + iters) * programs - 1) // total
                slot = tl.where(start > tile_start, 0, 1)
                tl.store(ws + (pid * 2 + slot) * PARTS * tile_elems, acc)
                if SWIGLU:
                    tl.store(ws + ((pid * 2 + slot) * PARTS + 1) * tile_elems, acc_up)
                tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
                arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
                owns = arrived == last - first
                if owns:  # the last to arrive: add every contributor's partial in contributor order
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for p in range(first, last + 1):
                        p_slot = tl.where(p * total // programs > tile_start, 0, 1)
                        acc += tl.load(ws + (p * 2 + p_slot) * PARTS * tile_elems, cache_modifier=".cg")
                        if SWIGLU:
                            acc_up += tl.load(ws + ((p * 2 + p_slot) * PARTS + 1) * tile_elems,
                                              cache_modifier=".cg")
                    tl.store(count_ptr + tile, 0)  # ready for the next launch
            if owns:
                offs_m = off_m + rm
                offs_n = off_n + rn
                if HAS_BIAS:
                    acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
                out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
                act = out_ptr.dtype.element_ty
                if SWIGLU:  # triton_ops._silu_mul's maths on the rounded sums: the bits of silu_and_mul(x @ W.T)
                    g = acc.to(act).to(tl.float32)
                    silu = (g / (1.0 + tl.exp(-g))).to(act)
                    acc = silu.to(tl.float32) * acc_up.to(act).to(tl.float32)
                tl.store(out_ptrs, acc.to(act), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


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
    counters: torch.Tensor | None = None,  # [>= num_tiles] int32 zeros (stream-K only)
    programs: int | None = None,
) -> torch.Tensor:  # [num_rows, out_features], out_dtype (default x.dtype)
    """``F.linear(x, weight, bias)`` in one launch with fp32 sums (up to summation order; bias added in fp32, one
    rounding to ``out_dtype``; ``torch.float32`` keeps the sums unrounded). ``config`` defaults to
    ``quant_tiles.bf16_gemm_config(M, N, K)`` (a ``ValueError`` when the table has none for this shape); its
    ``tma`` is honoured only where both operands are TMA-aligned, else the pointer path runs.

    Stream-K configurations (``config.stream_k``) launch ``programs`` persistent programs (default:
    ``config.programs_per_sm`` per multiprocessor of the device; at most one per iteration) and take
    ``counters``, the caller's zeroed arrival counters (``linear.Linear.gemm_counters``; the launch leaves them
    zeroed): without them, or too few, a zeroed buffer is made for the call (one more small kernel)."""
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
    if cfg.stream_k:
        _launch_streamk(x, xs, ws, weight, bias, out, cfg, block_k, use_tma, counters, programs, swiglu=False)
        return out
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



def _launch_streamk(
    x: torch.Tensor,  # [M, K]
    xs, ws,  # x and the weight as the kernel reads them (tensors, or TensorDescriptors when use_tma)
    weight: torch.Tensor,  # [N, K] ([2N, K] gate | up with swiglu)
    bias: torch.Tensor | None,  # [N]
    out: torch.Tensor,  # [M, N]
    cfg: TileConfig, block_k: int, use_tma: bool,
    counters: torch.Tensor | None,  # [>= num_tiles] int32 zeros
    programs: int | None, swiglu: bool,
) -> None:
    m, n = out.shape
    k = x.shape[1]
    block_m, block_n = cfg.block_m or 128, cfg.block_n
    num_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    total = num_tiles * triton.cdiv(k, block_k)
    grid = (max(1, min(programs or cfg.programs_per_sm * num_sms(x.device), total)),)  # each >= 1 iteration
    partial = torch.empty((grid[0], 2, 2 if swiglu else 1, block_m, block_n), dtype=torch.float32, device=x.device)
    if counters is None or counters.numel() < num_tiles:
        counters = torch.zeros(num_tiles, dtype=torch.int32, device=x.device)
    _streamk_kernel[grid](
        xs, ws, weight if bias is None else bias, out, partial, counters,
        m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, USE_TMA=use_tma, SWIGLU=swiglu,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device),
    )


def gemm_swiglu(
    x: torch.Tensor,  # [num_rows, in_features] bf16 / fp16
    weight: torch.Tensor,  # [2 * intermediate, in_features], x.dtype: gate rows, then up rows
    config: TileConfig,
    counters: torch.Tensor | None = None,  # [>= num_tiles] int32 zeros
    programs: int | None = None,
) -> torch.Tensor:  # [num_rows, intermediate], x.dtype
    """``silu_and_mul(F.linear(x, weight))`` in one stream-K launch (``config.stream_k`` required): each output
    tile holds the gate and the up sums of the same columns (two accumulators), rounds both to x's dtype and
    applies ``triton_ops._silu_mul``'s maths, so the result is the two-kernel path's up to the GEMM's fp32
    summation order, and the ``[num_rows, 2 * intermediate]`` product is never written."""
    m, k = x.shape
    if not gemm_supported(x, weight) or weight.shape[0] % 2:
        raise ValueError(f"gemm_swiglu takes 2D bf16 / fp16 x and a weight of x's dtype with matching in_features "
                         f"and an even number of rows, got x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if not config.stream_k:
        raise ValueError("gemm_swiglu needs a stream-K configuration (config.stream_k)")
    n = weight.shape[0] // 2
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_m, block_n = config.block_m or 128, config.block_n
    block_k = min(config.block_k, max(16, triton.next_power_of_2(k)))
    use_tma = config.tma and _tma_ok(x) and _tma_ok(weight)
    if use_tma:
        xs = TensorDescriptor(x, shape=[m, k], strides=[x.stride(0), 1], block_shape=[block_m, block_k])
        ws = TensorDescriptor(weight, shape=[2 * n, k], strides=[weight.stride(0), 1],
                              block_shape=[block_n, block_k])
    else:
        xs, ws = x, weight
    _launch_streamk(x, xs, ws, weight, None, out, config, block_k, use_tma, counters, programs, swiglu=True)
    return out
