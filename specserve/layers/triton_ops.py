"""A decoder layer's elementwise operations on GPU as one Triton kernel each: ``TritonOps``.

Once a decode step is replayed from a CUDA graph (``engine/cuda_graphs.py``), what is left of its cost on a
small model is the number of kernels: the tensors are a few KB, so each launch costs its fixed ~2-4 us of
GPU time whatever it computes. ``TorchOps`` (``layers/ops.py``) spends most of a layer's ~30 kernels on
glue that one kernel can do in a single pass over the row:

    op                    TorchOps kernels                                            here
    rms_norm              float, pow, mean, add eps + rsqrt, mul, to(dtype), * weight   ~7      1
    fused_add_rms_norm    residual add + rms_norm                                       ~8      1
    rope_                 cat(-x2, x1) (neg + cat), two muls, add, copy_ back            ~6      1
    silu_and_mul          silu, mul (+ a copy of a non-contiguous chunk)                2-3      1

so a Llama layer (2 norms, rope, silu_and_mul, 4 GEMMs, 2-3 attention kernels) goes from ~30 kernels to
about 10. RMSNorm is
Zhang & Sennrich, arXiv 1910.07467; the rotary embedding is RoFormer (Su et al., arXiv 2104.09864) in the
rotate-half layout of ``layers/rope.py``.

Numerics follow ``TorchOps`` step by step: everything is computed in fp32 and rounded to the activation dtype
exactly where torch rounds, so that the GPU path and the torch reference agree to the last bit or within a
couple of ulps:

- rms_norm, bf16/fp16: ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``: the normalised row is rounded to
  the activation dtype before the weight multiply, and that product is rounded again (torch multiplies two
  bf16 tensors in fp32 and rounds once; so do we). fp32: ``x * rsqrt(mean(x^2) + eps) * weight``, what
  ``F.rms_norm`` computes. The sum of squares is a tree reduction, not torch's order, and ``rsqrt`` is the
  hardware's, so ``rstd`` can differ in its last fp32 bits: fp32 outputs agree within a few ulps (``F.rms_norm``
  on CPU is up to ~5 ulps from the plain expression), and a 16-bit output can, rarely, be off where
  ``x * rstd`` sits on a rounding boundary: one ulp there, at most two after the weight multiply (under the
  interpreter bf16 came out bitwise equal in every case tested, fp16 within two ulps).
- fused_add_rms_norm: the residual add is the activation dtype's correctly rounded sum (an fp32 add rounded
  once to the activation dtype: exact for fp32 and, as fp32's 24 bits are >= 2p + 2 for p = 8 (bf16) and 11
  (fp16) bits, equal to torch's bf16/fp16 add), so the updated residual is bitwise torch's; the norm is as
  above.
- rope_: ``x * cos`` and ``rotated * sin`` are each rounded to the activation dtype before their sum, as torch
  does for bf16/fp16; the launch turns off fp contraction (``enable_fp_fusion=False``) so the fp32 path is
  not fused into an FMA either. Bitwise torch's on every dtype.
- silu_and_mul: ``silu(gate)`` as ``g / (1 + exp(-g))`` in fp32, rounded to the activation dtype, times
  ``up`` rounded once more (torch's two kernels). ``exp`` is Triton's, not torch's (on GPU the fast
  ``ex2.approx``-based one): fp32 results agree to a few ulps (more for large negative gates on GPU, where
  the exp's argument rounding shows), 16-bit ones within two ulps (bitwise in the interpreter's bf16 tests).

FP8 activations, opt-in (``rms_norm_fp8``, ``fused_add_rms_norm_fp8``, ``silu_and_mul_fp8``; wired into the
Llama layers by ``quant_tiles.FUSE_FP8_ACT_QUANT``). An FP8 projection (``quant_gpu.Fp8Linear``, e4m3 as in
Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433) quantizes its input per token with the
fused quantizer (``triton_w8a16.quantize_fp8_rows_triton``) before every GEMM: one more launch, and one more
read of the row, per projection. Three of a layer's four projection inputs come out of the ops above (qkv's
from the input norm, gate_up's from the post-attention norm, down's from silu_and_mul), which already hold the
whole row in registers (the norms) or can (silu_and_mul, one program per row in the fused variant), so the
``_fp8`` variants also emit the e4m3 row and its fp32 scale, in an ``Fp8Activations`` that ``Fp8Linear`` takes
instead of the 16-bit tensor. Exactness: the variants quantize the op's *rounded* output (its bf16/fp16 value
converted back to fp32: exact) with the quantizer's own ``@triton.jit`` helpers (``_fp8_scale``: the row amax
/ 448 with IEEE division, at least 1e-12; ``_fp8_quantize``: IEEE division, clamp to +-448, e4m3 round to
nearest even), so ``x_q`` and ``scale`` are bit for bit ``quantize_fp8_rows(op(...))`` and the projection's
output is unchanged. The 16-bit output is written only when asked (``write_out``); ``fused_add_rms_norm_fp8``
still updates the residual in place.

Layouts the kernels do not take (another dtype, a weight dtype different from the activations', a last
dimension that is not contiguous (``rms_norm`` copies such rows instead), a ``qk`` whose heads are not
``head_dim`` apart, cos/sin of another dtype than ``qk``, hidden sizes past ``MAX_HIDDEN``) fall back to
``TorchOps``. Every launch decision uses host shapes and strides only (no ``.item()``, no sync),
so the ops can be captured in CUDA graphs. On CPU the same kernels run under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported); that is how the unit tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.layers.ops import TorchOps
from specserve.layers.quant_gpu import FP8_DTYPE, Fp8Activations, quantize_fp8_activations
from specserve.layers.triton_pdl import pdl_args, pdl_begin
from specserve.layers.triton_rope import rope_block_heads, rope_cos_sin, rope_rotate_, rope_tables_match
from specserve.layers.triton_w8a16 import _fp8_quantize, _fp8_scale

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Widest row a norm program holds in registers (a Llama-405B hidden is 16384); wider rows use TorchOps.
MAX_HIDDEN = 32768
# Elements one norm program covers: rows are stacked up to this many so that a small hidden (QK-norm's
# head_dim) still gives each program a useful amount of work.
NORM_TILE = 1024
SILU_BLOCK = 1024  # output columns per silu_and_mul program
# silu_and_mul_fp8 (one program per row, for the row's amax): rows up to this many columns stay in registers
# (Llama-3-8B's 14336 does); wider ones are computed twice, once for the amax and once to quantize.
SILU_FP8_MAX_BLOCK = 16384
# ... but one program per row leaves a row's ~30 operations per element (exp, two IEEE divisions, roundings) to a
# single multiprocessor: 5.8 us for a Llama-3.1-8B row (14336 columns) on an H200, four times the unfused op's
# 1.45 us (benchmarks/results/verify_profile_b1_fp8_gpu.json). Up to this many rows (decode and verify steps) of at
# least SILU_FP8_SPLIT_MIN_COLS columns the fused op runs as two launches over SILU_FP8_SPLIT_BLOCK-column blocks
# instead: silu_and_mul with each block's amax, then the quantizer taking the row amax from those partial ones.
# Same operations on the same values (the 16-bit output is stored and read back exactly; a max of maxes is the
# max), so the same bits. On the H200 (benchmarks/results/silu_fp8_split_gpu.json, graph-replayed steps, logits
# bitwise equal, two runs) the Llama-3.1-8B FP8 step went x1.024 / x1.031 at batch 1, x0.985 / x1.023 for a batch-1
# verify of 6 tokens, x1.010 / x1.010 at batch 8; SmolLM2's 1,536 columns went x0.978 / x0.985 (one program covers
# them quickly and the second launch costs more), hence the column floor.
SILU_FP8_SPLIT_MAX_ROWS = 16
SILU_FP8_SPLIT_MIN_COLS = 4096
SILU_FP8_SPLIT_BLOCK = 1024


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _num_warps(elements: int) -> int:
    """Warps for a program covering ``elements`` values: 8 per thread (16-byte bf16 loads), 1..16 warps."""
    return min(max(elements // 256, 1), 16)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, hidden_size], row stride stride_x, columns contiguous
    residual_ptr,  # [num_rows, hidden_size], row stride stride_r: residual += x in place (HAS_RESIDUAL only)
    weight_ptr,  # [hidden_size]
    out_ptr,  # [num_rows, hidden_size] contiguous
    num_rows, hidden_size, stride_x, stride_r,
    eps,
    q_ptr,  # [num_rows, hidden_size] float8_e4m3fn contiguous: the output quantized per row (QUANT only)
    scale_ptr,  # [num_rows] fp32 (the [num_rows, 1] scale column) (QUANT only)
    HAS_RESIDUAL: tl.constexpr,
    ROUND_NORMED: tl.constexpr,  # bf16/fp16: round x * rstd to the activation dtype before * weight
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= hidden_size
    QUANT: tl.constexpr,  # also emit out's e4m3 row and scale (triton_w8a16's fused quantizer's bits)
    WRITE_OUT: tl.constexpr,  # store the activation-dtype output
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    pdl_begin(USE_PDL)
    # One program normalises BLOCK_ROWS whole rows, each held in registers: one read, one write per element.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < hidden_size)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    act = x.dtype
    xf = x.to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + rows[:, None] * stride_r + cols[None, :]
        # fp32 sum rounded once to the activation dtype: torch's residual.add_(x), bit for bit
        x = (xf + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(act)
        tl.store(r_ptrs, x, mask=mask)
        xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / hidden_size + eps)  # [BLOCK_ROWS]
    w = tl.load(weight_ptr + cols, mask=cols < hidden_size, other=0.0).to(tl.float32)
    normed = xf * rstd[:, None]
    if ROUND_NORMED:
        normed = normed.to(act).to(tl.float32)
    out = (normed * w[None, :]).to(act)
    if WRITE_OUT:
        tl.store(out_ptr + rows[:, None] * hidden_size + cols[None, :], out, mask=mask)
    if QUANT:
        # the rounded output, exactly, in fp32 (padding columns and rows are 0 and leave the amax alone)
        of = out.to(tl.float32)
        scale = _fp8_scale(tl.max(tl.abs(of), axis=1))  # [BLOCK_ROWS]
        tl.store(scale_ptr + rows, scale, mask=rows < num_rows)
        tl.store(q_ptr + rows[:, None] * hidden_size + cols[None, :], _fp8_quantize(of, scale[:, None]), mask=mask)


@triton.jit
def _silu_mul(
    in_row,  # [2 * intermediate_size] one row of gate | up, columns contiguous
    intermediate_size,
    cols,  # [BLOCK] output columns (those >= intermediate_size give 0)
):
    """silu(gate) * up of ``cols`` in the activation dtype: ``F.silu``'s fp32 maths rounded to the activation
    dtype, times ``up`` rounded once more (torch's two kernels). Shared by both silu kernels (the same bits)."""
    mask = cols < intermediate_size
    gate = tl.load(in_row + cols, mask=mask, other=0.0)
    up = tl.load(in_row + intermediate_size + cols, mask=mask, other=0.0)
    act = gate.dtype
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(act)  # F.silu: fp32 math, rounded to the activation dtype
    return (silu.to(tl.float32) * up.to(tl.float32)).to(act)


@triton.jit
def _silu_and_mul_fp8_kernel(
    gate_up_ptr,  # [num_rows, 2 * intermediate_size], row stride stride_in, columns contiguous
    out_ptr,  # [num_rows, intermediate_size] contiguous (WRITE_OUT only)
    q_ptr,  # [num_rows, intermediate_size] float8_e4m3fn contiguous
    scale_ptr,  # [num_rows] fp32 (the [num_rows, 1] scale column)
    intermediate_size, stride_in,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,  # BLOCK >= intermediate_size: the row stays in registers
    WRITE_OUT: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    pdl_begin(USE_PDL)
    # One program per row: silu_and_mul's output (``_silu_mul``), then the fused quantizer's maths on it. A row
    # wider than BLOCK is computed twice (amax pass, quantize pass): the same operations, so the same values.
    row = tl.program_id(0).to(tl.int64)
    in_row = gate_up_ptr + row * stride_in
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        out = _silu_mul(in_row, intermediate_size, offs)
        of = out.to(tl.float32)
        amax = tl.max(tl.abs(of), axis=0)
        if WRITE_OUT:
            tl.store(out_ptr + row * intermediate_size + offs, out, mask=offs < intermediate_size)
    else:
        running = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, intermediate_size, BLOCK):
            out = _silu_mul(in_row, intermediate_size, c0 + offs)
            running = tl.maximum(running, tl.abs(out.to(tl.float32)))
            if WRITE_OUT:
                tl.store(out_ptr + row * intermediate_size + c0 + offs, out, mask=c0 + offs < intermediate_size)
        amax = tl.max(running, axis=0)
    scale = _fp8_scale(amax)
    tl.store(scale_ptr + row, scale)
    q_row = q_ptr + row * intermediate_size
    if ONE_PASS:
        tl.store(q_row + offs, _fp8_quantize(of, scale), mask=offs < intermediate_size)
    else:
        for c0 in range(0, intermediate_size, BLOCK):
            of = _silu_mul(in_row, intermediate_size, c0 + offs).to(tl.float32)
            tl.store(q_row + c0 + offs, _fp8_quantize(of, scale), mask=c0 + offs < intermediate_size)


@triton.jit
def _silu_and_mul_amax_kernel(
    gate_up_ptr,  # [num_rows, 2 * intermediate_size], row stride stride_in, columns contiguous
    out_ptr,  # [num_rows, intermediate_size] contiguous
    amax_ptr,  # [num_rows, num_blocks] fp32: each column block's amax of |out|
    intermediate_size, stride_in, num_blocks,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    """The first launch of the split ``silu_and_mul_fp8``: program (row, block) writes ``_silu_mul`` for BLOCK
    columns, as ``_silu_and_mul_kernel`` does, and their amax (columns past the row give 0)."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    out = _silu_mul(gate_up_ptr + row * stride_in, intermediate_size, cols)
    tl.store(out_ptr + row * intermediate_size + cols, out, mask=cols < intermediate_size)
    tl.store(amax_ptr + row * num_blocks + block, tl.max(tl.abs(out.to(tl.float32)), axis=0))


@triton.jit
def _quantize_blocks_kernel(
    x_ptr,  # [num_rows, num_cols] contiguous, the activation dtype
    amax_ptr,  # [num_rows, num_blocks] fp32 partial amaxes of |x| (``_silu_and_mul_amax_kernel``)
    q_ptr,  # [num_rows, num_cols] float8_e4m3fn contiguous
    scale_ptr,  # [num_rows] fp32 (the [num_rows, 1] scale column)
    num_cols, num_blocks,
    BLOCK: tl.constexpr,
    BLOCKS_POW2: tl.constexpr,  # next power of two >= num_blocks
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    """The second launch: program (row, block) takes the row's scale from its partial amaxes (``_fp8_scale``;
    block 0 stores it) and quantizes BLOCK columns with it (``_fp8_quantize``), the one-program kernel's maths."""
    pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    parts = tl.arange(0, BLOCKS_POW2)
    amax = tl.max(tl.load(amax_ptr + row * num_blocks + parts, mask=parts < num_blocks, other=0.0), axis=0)
    scale = _fp8_scale(amax)
    if block == 0:
        tl.store(scale_ptr + row, scale)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    xf = tl.load(x_ptr + row * num_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * num_cols + cols, _fp8_quantize(xf, scale), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [num_rows, 2 * intermediate_size], row stride stride_in, columns contiguous
    out_ptr,  # [num_rows, intermediate_size] contiguous
    intermediate_size, stride_in,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    pdl_begin(USE_PDL)
    # Program (row, column block): silu(gate) * up for BLOCK columns of one row.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    out = _silu_mul(gate_up_ptr + row * stride_in, intermediate_size, cols)
    tl.store(out_ptr + row * intermediate_size + cols, out, mask=cols < intermediate_size)


@triton.jit
def _rope_kernel(
    qk_ptr,  # [num_tokens, num_heads, head_dim], row stride stride_t, head stride head_dim; rotated in place
    cos_ptr,  # [num_tokens, 1, head_dim], row stride stride_c, last dim contiguous
    sin_ptr,  # [num_tokens, 1, head_dim], row stride stride_s, last dim contiguous
    num_heads, stride_t, stride_c, stride_s,
    HALF: tl.constexpr,  # head_dim // 2
    HALF_PAD: tl.constexpr,  # next power of two >= HALF
    BLOCK_H: tl.constexpr,  # heads per program
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    pdl_begin(USE_PDL)
    # Program (token, head block): rotate-half RoPE of BLOCK_H heads of one token, with the token's cos/sin
    # loaded once for all of them. x = [x1 | x2] per head, halves of HALF values:
    #   out1 = x1 * cos1 - x2 * sin1,   out2 = x2 * cos2 + x1 * sin2
    # (torch: x * cos + cat(-x2, x1) * sin; each product rounded to the activation dtype before the sum).
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < HALF
    mask = (heads[:, None] < num_heads) & dim_mask[None, :]
    ptr1 = qk_ptr + tok * stride_t + heads[:, None] * (2 * HALF) + dims[None, :]
    cs = rope_cos_sin(cos_ptr + tok * stride_c, sin_ptr + tok * stride_s, HALF, HALF_PAD)
    rope_rotate_(ptr1, mask, cs, HALF)


def _rows_ok(t: torch.Tensor) -> bool:
    """A 2-D tensor whose rows may be strided but whose columns are contiguous."""
    return t.dim() == 2 and (t.stride(-1) == 1 or t.shape[-1] <= 1)


class TritonOps(TorchOps):
    """``TorchOps`` with each op one Triton kernel (shapes as in ``TorchOps``); unsupported layouts and dtypes
    go to the torch reference."""

    @staticmethod
    def _norm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype and weight.dim() == 1
                and weight.is_contiguous() and x.shape[-1] == weight.shape[0] <= MAX_HIDDEN)

    @staticmethod
    def _launch_norm(
        x: torch.Tensor,  # [num_rows, hidden_size], columns contiguous
        residual: torch.Tensor | None,  # [num_rows, hidden_size], columns contiguous; += x in place
        weight: torch.Tensor,  # [hidden_size]
        eps: float,
        quant: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([num_rows, hidden_size] e4m3, [num_rows, 1] fp32)
        write_out: bool = True,
    ) -> torch.Tensor | None:  # [num_rows, hidden_size] contiguous; None when not write_out
        """The norm launch; with ``quant`` it also writes the output's per-row e4m3 values and scales there."""
        num_rows, hidden = x.shape
        out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device) if write_out else None
        if num_rows == 0 or hidden == 0:
            if quant is not None:
                quant[1].fill_(1e-12)  # quantize_fp8_rows' scale of an empty row
            return out
        block = _next_pow2(hidden)
        block_rows = max(1, NORM_TILE // block)
        out_arg = x if out is None else out  # x: never stored to (WRITE_OUT off)
        q, scale = (out_arg, out_arg) if quant is None else quant  # out: never touched (QUANT off)
        _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
            x, x if residual is None else residual, weight, out_arg,
            num_rows, hidden, x.stride(0), 0 if residual is None else residual.stride(0),
            eps, q, scale,
            HAS_RESIDUAL=residual is not None, ROUND_NORMED=x.dtype != torch.float32,
            BLOCK_ROWS=block_rows, BLOCK=block, QUANT=quant is not None, WRITE_OUT=write_out,
            num_warps=_num_warps(block_rows * block), **pdl_args(x.device))
        return out

    def rms_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        weight: torch.Tensor,  # [hidden_size]
        eps: float,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if x.dim() < 1 or not self._norm_ok(x, weight):
            return TorchOps.rms_norm(x, weight, eps)
        rows = x if _rows_ok(x) else x.reshape(-1, x.shape[-1])  # leading dims flattened (a copy if need be)
        if not _rows_ok(rows):
            rows = rows.contiguous()
        return self._launch_norm(rows, None, weight, eps).view(x.shape)

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor,  # [num_tokens, hidden_size], updated in place: residual += x
        weight: torch.Tensor,  # [hidden_size]
        eps: float,
    ) -> torch.Tensor:  # rms_norm(residual + x)
        if (not self._norm_ok(x, weight) or not _rows_ok(x) or not _rows_ok(residual)
                or residual.shape != x.shape or residual.dtype != x.dtype):
            return TorchOps.fused_add_rms_norm(x, residual, weight, eps)
        return self._launch_norm(x, residual, weight, eps)

    def silu_and_mul(
        self,
        gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate_size]
    ) -> torch.Tensor:  # [num_tokens, intermediate_size]
        if gate_up.dtype not in KERNEL_DTYPES or not _rows_ok(gate_up) or gate_up.shape[-1] % 2:
            return TorchOps.silu_and_mul(gate_up)
        num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
        if num_rows == 0 or inter == 0:
            return out
        block = min(SILU_BLOCK, _next_pow2(inter))
        _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), BLOCK=block, num_warps=_num_warps(block),
            **pdl_args(gate_up.device))
        return out

    def rope_(
        self,
        qk: torch.Tensor,  # [num_tokens, num_q_heads + num_kv_heads, head_dim], rotated in place
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = qk.shape if qk.dim() == 3 else (0, 0, 0)
        supported = (
            qk.dim() == 3 and qk.dtype in KERNEL_DTYPES and rope_tables_match(qk, cos, sin)
            and (num_heads <= 1 or qk.stride(1) == head_dim) and qk.stride(2) == 1)
        if not supported:
            return TorchOps.rope_(qk, cos, sin)
        if num_tokens == 0 or num_heads == 0 or head_dim == 0:
            return qk
        half_pad, block_h = rope_block_heads(num_heads, head_dim)
        _rope_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            qk, cos, sin, num_heads, qk.stride(0), cos.stride(0), sin.stride(0),
            HALF=head_dim // 2, HALF_PAD=half_pad, BLOCK_H=block_h, num_warps=_num_warps(block_h * half_pad),
            enable_fp_fusion=False, **pdl_args(qk.device))
        return qk

    # ---- FP8 activations: the op and the fused quantizer in one launch (see the module docstring) ----------------
    @staticmethod
    def _fp8_buffers(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty((rows, cols), dtype=FP8_DTYPE, device=device),  # [rows, cols] e4m3
                torch.empty((rows, 1), dtype=torch.float32, device=device))  # [rows, 1] fp32

    @staticmethod
    def _quantized(out: torch.Tensor, write_out: bool) -> Fp8Activations:
        """The fallback: the unfused op's ``out [num_rows, num_cols]`` through the fused quantizer (same bits)."""
        rows = out.reshape(-1, out.shape[-1])
        x_q, scale = quantize_fp8_activations(rows)
        return Fp8Activations(x_q, scale, out.dtype, rows if write_out else None)

    def rms_norm_fp8(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        weight: torch.Tensor,  # [hidden_size]
        eps: float,
        write_out: bool = False,
    ) -> Fp8Activations:  # x_q [num_tokens, hidden_size] e4m3, scale [num_tokens, 1]; x only if write_out
        """``rms_norm`` and the fused FP8 quantizer in one launch: ``x_q, scale`` are bit for bit
        ``quantize_fp8_rows(self.rms_norm(x, weight, eps))``."""
        if x.dim() != 2 or not self._norm_ok(x, weight) or not _rows_ok(x):
            return self._quantized(self.rms_norm(x, weight, eps), write_out)
        quant = self._fp8_buffers(*x.shape, x.device)
        return Fp8Activations(*quant, x.dtype, self._launch_norm(x, None, weight, eps, quant, write_out))

    def fused_add_rms_norm_fp8(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor,  # [num_tokens, hidden_size], updated in place: residual += x
        weight: torch.Tensor,  # [hidden_size]
        eps: float,
        write_out: bool = False,
    ) -> Fp8Activations:  # rms_norm(residual + x) quantized per token; x only if write_out
        """``fused_add_rms_norm`` (the residual updated in place, bit for bit) and the fused FP8 quantizer in one
        launch: ``x_q, scale`` are bit for bit ``quantize_fp8_rows(self.fused_add_rms_norm(...))``."""
        if (not self._norm_ok(x, weight) or not _rows_ok(x) or not _rows_ok(residual)
                or residual.shape != x.shape or residual.dtype != x.dtype):
            return self._quantized(self.fused_add_rms_norm(x, residual, weight, eps), write_out)
        quant = self._fp8_buffers(*x.shape, x.device)
        return Fp8Activations(*quant, x.dtype, self._launch_norm(x, residual, weight, eps, quant, write_out))

    def silu_and_mul_fp8(
        self,
        gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate_size]
        write_out: bool = False,
    ) -> Fp8Activations:  # x_q [num_tokens, intermediate_size] e4m3, scale [num_tokens, 1]; x only if write_out
        """``silu_and_mul`` and the fused FP8 quantizer in one launch, one program per row (the amax needs the
        whole row), or for a few wide rows in two launches over column blocks (``SILU_FP8_SPLIT_MAX_ROWS``):
        ``x_q, scale`` are bit for bit ``quantize_fp8_rows(self.silu_and_mul(gate_up))`` either way."""
        if gate_up.dtype not in KERNEL_DTYPES or not _rows_ok(gate_up) or gate_up.shape[-1] % 2:
            return self._quantized(self.silu_and_mul(gate_up), write_out)
        num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        x_q, scale = self._fp8_buffers(num_rows, inter, gate_up.device)
        out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device) if write_out else None
        if num_rows == 0 or inter == 0:
            scale.fill_(1e-12)
            return Fp8Activations(x_q, scale, gate_up.dtype, out)
        if num_rows <= SILU_FP8_SPLIT_MAX_ROWS and inter >= SILU_FP8_SPLIT_MIN_COLS:
            block = min(SILU_FP8_SPLIT_BLOCK, _next_pow2(inter))
            blocks = triton.cdiv(inter, block)
            if out is None:
                out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
            amax = torch.empty((num_rows, blocks), dtype=torch.float32, device=gate_up.device)
            _silu_and_mul_amax_kernel[(num_rows, blocks)](
                gate_up, out, amax, inter, gate_up.stride(0), blocks, BLOCK=block, num_warps=_num_warps(block),
                **pdl_args(gate_up.device))
            _quantize_blocks_kernel[(num_rows, blocks)](
                out, amax, x_q, scale, inter, blocks, BLOCK=block, BLOCKS_POW2=_next_pow2(blocks),
                num_warps=_num_warps(block), **pdl_args(gate_up.device))
            return Fp8Activations(x_q, scale, gate_up.dtype, out if write_out else None)
        block = min(_next_pow2(inter), SILU_FP8_MAX_BLOCK)
        _silu_and_mul_fp8_kernel[(num_rows,)](
            gate_up, gate_up if out is None else out, x_q, scale, inter, gate_up.stride(0),  # never stored to
            BLOCK=block, ONE_PASS=block >= inter, WRITE_OUT=write_out, num_warps=_num_warps(block),
            **pdl_args(gate_up.device))
        return Fp8Activations(x_q, scale, gate_up.dtype, out)
