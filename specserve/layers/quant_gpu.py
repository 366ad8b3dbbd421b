"""Quantized projection weights for accelerators: FP8 e4m3 (weights and activations) and INT4 weight-only.

FP8 (Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433). The e4m3 format has 4 exponent
and 3 mantissa bits, a largest finite value of 448 and no infinities (``torch.float8_e4m3fn``). Weights get one
scale per output channel (row of ``[out_features, in_features]``) chosen at load time, ``scale = amax / 448``;
activations get one scale per token (row), computed on the fly inside the forward (no calibration, no host
sync). The product ``(x_q * s_x) @ (w_q * s_w).T = s_x * (x_q @ w_q.T) * s_w`` runs on the tensor cores through
``torch._scaled_mm`` with row-wise scales (``[M, 1]`` and ``[1, N]``), accumulating in fp32 and writing bf16;
on CUDA one Triton kernel quantizes the activations (``layers/triton_w8a16.py``). At decode sizes (M up to
``quant_tiles.W8A16_MAX_ROWS``) the GEMM is a weight-bandwidth-bound GEMV: there a Triton W8A16 kernel reads
the e4m3 weights once and takes the same per-token e4m3 activations (from the fused quantizer; the kernel can
also quantize them itself, bit for bit the same, but that measured slower on an H200:
``quant_tiles.W8A16_INKERNEL_QUANT_MAX_ROWS``), so every row count computes ``fp8_linear_reference``'s maths: a
token's output does not depend on how many rows share its step (decode at batch b vs a speculative verify of
b x (k + 1) rows) beyond fp32 summation order (and, up to 32 rows, the fp8 MMA's partial-sum rounding: see
``triton_w8a16``). (``activation_quant="none"`` keeps the older unquantized-activation
W8A16 maths, ``w8a16_linear_reference``, whose small-M results differ from the _scaled_mm path's.)
Off the accelerator the same maths runs as a reference (dequantize both operands, fp32 matmul).

INT4 (weight-only, group-wise, as in AWQ: Lin et al., "AWQ: Activation-aware Weight Quantization for LLM
Compression and Acceleration", arXiv 2306.00978). Every ``group_size`` consecutive input features of an output
channel share a scale ``s`` and an integer zero point ``z`` in [0, 15] (asymmetric):

    q = clamp(round(w / s) + z, 0, 15),  s = (max - min) / 15,  z = clamp(round(-min / s), 0, 15)
    w ~= (q - z) * s

We quantize by round-to-nearest (no activation-aware scale search; an AWQ checkpoint would bring searched
scales, and its (q, s, z) use exactly this dequantization formula). Layout, chosen for the GEMM kernel
(``layers/triton_w4a16.py``), which reads 8 consecutive k of one output column from one int32:

    qweight [in_features // 8, out_features] int32: bits 4*j..4*j+3 of qweight[k // 8, n] hold q[n, k], j = k % 8
    scales  [in_features // group_size, out_features]  activation dtype
    zeros   [in_features // group_size, out_features]  activation dtype (integers 0..15, exact in bf16/fp16)

Activations stay in their dtype (W4A16): the kernel dequantizes weight tiles in registers and accumulates in
fp32. Decoding is bound by weight bytes, so 4-bit weights read ~4x fewer bytes than bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.layers import quant_tiles

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
INT4_GROUP_SIZE = 128
INT4_MAX = 15
_MIN_SCALE = 1e-12


# ---- FP8 -------------------------------------------------------------------------------------------------
def quantize_fp8_rows(
    x: torch.Tensor,  # [num_rows, num_cols]
) -> tuple[torch.Tensor, torch.Tensor]:  # (x_q [num_rows, num_cols] float8_e4m3fn, scale [num_rows, 1] float32)
    """One scale per row (per output channel of a weight, per token of an activation): ``x ~= x_q * scale``."""
    xf = x.float()
    # the divisor is a tensor on x's device: CUDA torch turns division by a Python number into a multiply by
    # its rounded reciprocal (1 ulp off IEEE division at times), and the Triton quantizers divide exactly
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [num_rows, 1]
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=_MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8_rows(
    x_q: torch.Tensor,  # [num_rows, num_cols] float8_e4m3fn
    scale: torch.Tensor,  # [num_rows, 1] float32
) -> torch.Tensor:  # [num_rows, num_cols] float32
    return x_q.float() * scale


def quantize_fp8_activations(
    x: torch.Tensor,  # [num_rows, num_cols]
) -> tuple[torch.Tensor, torch.Tensor]:  # (x_q [num_rows, num_cols] float8_e4m3fn, scale [num_rows, 1] float32)
    """``quantize_fp8_rows`` for activations: one fused Triton kernel on CUDA (the same bits), torch elsewhere."""
    if x.is_cuda:
        from specserve.layers.triton_w8a16 import quantize_fp8_rows_triton  # Triton only on the kernel path
        return quantize_fp8_rows_triton(x)
    return quantize_fp8_rows(x)


@dataclass(frozen=True)
class Fp8Activations:
    """Activations already quantized per token, as ``quantize_fp8_rows`` would quantize the 16-bit tensor
    ``x``: produced by the Triton ops that fuse the quantizer into the op that computes ``x``
    (``TritonOps.rms_norm_fp8`` / ``fused_add_rms_norm_fp8`` / ``silu_and_mul_fp8``), taken by
    ``Fp8Linear.forward`` in place of ``x`` (it then skips its own quantizer: the same e4m3 bits and scales,
    so the same output). ``x`` itself is kept only when the producer was asked to write it."""

    x_q: torch.Tensor  # [num_rows, num_cols] float8_e4m3fn
    scale: torch.Tensor  # [num_rows, 1] float32
    dtype: torch.dtype  # the activation dtype the projection's output takes (x's)
    x: torch.Tensor | None = None  # [num_rows, num_cols] the 16-bit activations, when written

    @property
    def shape(self) -> torch.Size:
        return self.x_q.shape


def w8a16_linear_reference(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    weight_scale: torch.Tensor,  # [1, out_features] float32
    bias: torch.Tensor | None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features], x.dtype
    """The W8A16 kernel's maths with ``act_quant="none"`` (``triton_w8a16.w8a16_linear``; not ``Fp8Linear``'s
    default): e4m3 weights dequantized exactly, activations not quantized, fp32 products and sums, the
    per-channel scale and bias applied to the fp32 sums."""
    out = (x.float() @ weight.float().t()) * weight_scale.reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_linear_reference(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    weight_scale: torch.Tensor,  # [1, out_features] float32
    bias: torch.Tensor | None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features], x.dtype
    """The FP8 GEMM's maths in plain torch, for every row count and path of ``Fp8Linear`` (the W8A16 kernel's
    default, ``act_quant="per_token"``, and _scaled_mm's): per-token activation quantization
    (``quantize_fp8_rows``), exact fp32 products of e4m3 values summed in fp32, then ``* x_scale * weight_scale``
    and the bias. Implementations differ from it (and from each other) only in summation order."""
    return fp8_linear_reference_quantized(*quantize_fp8_rows(x), weight, weight_scale, bias, x.dtype)


def fp8_linear_reference_quantized(
    x_q: torch.Tensor,  # [num_rows, in_features] float8_e4m3fn
    x_scale: torch.Tensor,  # [num_rows, 1] float32
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    weight_scale: torch.Tensor,  # [1, out_features] float32
    bias: torch.Tensor | None,  # [out_features]
    dtype: torch.dtype,
) -> torch.Tensor:  # [num_rows, out_features], dtype
    """``fp8_linear_reference`` after its quantizer: activations already per-token e4m3 (``quantize_fp8_rows``'
    output, or an ``Fp8Activations``' fields, the same bits), dequantized exactly."""
    out = (x_q.float() @ weight.float().t()) * x_scale * weight_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def fp8_linear_scaled_mm(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    weight_scale: torch.Tensor,  # [1, out_features] float32
    bias: torch.Tensor | None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features], x.dtype
    """Tensor-core FP8 GEMM: ``torch._scaled_mm`` with row-wise scales (sm_89+ on CUDA). ``_scaled_mm`` wants the
    second operand column-major, which ``weight.t()`` of a row-major ``[N, K]`` weight is; K and N must be
    multiples of 16. Row-wise scaling writes bf16, cast to ``x.dtype`` afterwards if that differs.
    ``use_fast_accum=False``: Hopper's FP8 MMA keeps only part of the fp32 accumulator's mantissa unless the
    partial sums are promoted periodically (DeepSeek-V3, arXiv 2412.19437, section 3.3.2); without that promotion
    this path would round differently from the W8A16 kernel beyond summation order, and a verify step (many
    rows) would score tokens differently from a decode step (few rows)."""
    return fp8_linear_scaled_mm_quantized(*quantize_fp8_activations(x), weight, weight_scale, bias, x.dtype)


def fp8_linear_scaled_mm_quantized(
    x_q: torch.Tensor,  # [num_rows, in_features] float8_e4m3fn
    x_scale: torch.Tensor,  # [num_rows, 1] float32
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    weight_scale: torch.Tensor,  # [1, out_features] float32
    bias: torch.Tensor | None,  # [out_features]
    dtype: torch.dtype,
) -> torch.Tensor:  # [num_rows, out_features], dtype
    """``fp8_linear_scaled_mm`` after its quantizer (activations already per-token e4m3)."""
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=torch.bfloat16,
                           use_fast_accum=False)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(dtype)


class Fp8Linear(nn.Module):
    """A projection with e4m3 weights and one fp32 scale per output channel.

    Rows up to ``max_triton_rows`` (None: ``quant_tiles.W8A16_MAX_ROWS`` at call time) go through the Triton
    W8A16 kernel when ``use_triton`` (None: on CUDA tensors); more rows through ``torch._scaled_mm`` when
    ``use_scaled_mm`` (None: off CPU), else the reference maths. ``activation_quant``: "per_token" (default)
    quantizes activations per token on every path, identically (``fp8_linear_reference``), so results do not
    depend on the row count beyond summation order; the kernel quantizes them itself up to
    ``quant_tiles.W8A16_INKERNEL_QUANT_MAX_ROWS`` rows and takes them from the fused quantizer above. "none":
    the W8A16 kernel multiplies unquantized activations (``w8a16_linear_reference``; larger row counts stay
    quantized, so a token's logits then depend on its step's row count)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 use_scaled_mm: bool | None = None, use_triton: bool | None = None,
                 max_triton_rows: int | None = None, activation_quant: str = "per_token") -> None:
        super().__init__()
        if activation_quant not in ("per_token", "none"):
            raise ValueError(f"activation_quant: {activation_quant!r} is not 'per_token' or 'none'")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # [out_features, in_features] float8_e4m3fn
        self.register_buffer("weight_scale", weight_scale.reshape(1, -1).contiguous())  # [1, out_features] fp32
        self.register_buffer("bias", bias)  # [out_features] or None
        # [cdiv(out_features, 8) * 4] int32, zero between launches: arrival counters of split-K kernel launches
        self.register_buffer("split_counters", _split_counters(self.out_features, weight.device), persistent=False)
        self.use_scaled_mm = use_scaled_mm
        self.use_triton = use_triton
        self.max_triton_rows = max_triton_rows
        self.activation_quant = activation_quant

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, use_scaled_mm: bool | None = None,
                   use_triton: bool | None = None, activation_quant: str = "per_token") -> Fp8Linear:
        """Quantize ``weight [out_features, in_features]`` with one scale per output channel."""
        w_q, w_scale = quantize_fp8_rows(weight.detach())
        return cls(w_q, w_scale, None if bias is None else bias.detach().clone(), use_scaled_mm, use_triton,
                   activation_quant=activation_quant)

    def forward(
        self,
        x: torch.Tensor | Fp8Activations,  # [num_rows, in_features]
    ) -> torch.Tensor:  # [num_rows, out_features]
        if isinstance(x, Fp8Activations):
            return self._forward_quantized(x)
        triton_ok = self.use_triton if self.use_triton is not None else x.is_cuda
        max_rows = quant_tiles.W8A16_MAX_ROWS if self.max_triton_rows is None else self.max_triton_rows
        if triton_ok and x.shape[0] <= max_rows:
            from specserve.layers.triton_w8a16 import w8a16_linear  # Triton is imported on the kernel path only
            act_quant = self.activation_quant
            if act_quant == "per_token" and x.shape[0] > quant_tiles.W8A16_INKERNEL_QUANT_MAX_ROWS:
                act_quant = "per_token_prequant"  # the fused quantizer first: the same e4m3 bits and scales
            return w8a16_linear(x, self.weight, self.weight_scale, self.bias, counters=self.split_counters,
                                act_quant=act_quant)
        use = self.use_scaled_mm if self.use_scaled_mm is not None else x.device.type != "cpu"
        fn = fp8_linear_scaled_mm if use else fp8_linear_reference
        return fn(x, self.weight, self.weight_scale, self.bias)

    def _forward_quantized(
        self,
        x: Fp8Activations,  # x_q [num_rows, in_features] e4m3, scale [num_rows, 1]
    ) -> torch.Tensor:  # [num_rows, out_features], x.dtype
        """``forward`` for activations a producer op already quantized (the fused quantizer's bits): the same
        paths with the quantizer skipped, so the same output as ``forward(x.x)``. In mode "none" (the kernel
        multiplies unquantized activations) the 16-bit ``x.x`` is required and used instead."""
        if self.activation_quant != "per_token":
            if x.x is None:
                raise ValueError("Fp8Activations without its 16-bit x: activation_quant='none' needs them")
            return self.forward(x.x)
        x_q, x_scale = x.x_q, x.scale
        triton_ok = self.use_triton if self.use_triton is not None else x_q.is_cuda
        max_rows = quant_tiles.W8A16_MAX_ROWS if self.max_triton_rows is None else self.max_triton_rows
        if triton_ok and x_q.shape[0] <= max_rows:
            from specserve.layers.triton_w8a16 import w8a16_linear  # Triton is imported on the kernel path only
            # in-kernel quantization and the pre-quantized mode give the same bits: take the given ones
            return w8a16_linear(x_q, self.weight, self.weight_scale, self.bias, counters=self.split_counters,
                                act_quant="per_token_prequant", x_scale=x_scale, out_dtype=x.dtype)
        use = self.use_scaled_mm if self.use_scaled_mm is not None else x_q.device.type != "cpu"
        fn = fp8_linear_scaled_mm_quantized if use else fp8_linear_reference_quantized
        return fn(x_q, x_scale, self.weight, self.weight_scale, self.bias, x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3 per-channel"


def _split_counters(out_features: int, device: torch.device) -> torch.Tensor:  # [cdiv(out_features, 8) * 4] int32
    """Zeroed arrival counters for the quantized kernels' in-launch split-K reduction (``triton_splitk.py``): a
    layer owns one, the kernels leave it zeroed (so CUDA graphs can replay launches that use it)."""
    return torch.zeros(-(-out_features // 8) * 4, dtype=torch.int32, device=device)


# ---- INT4 ------------------------------------------------------------------------------------------------
def pack_int4(
    q: torch.Tensor,  # [in_features, out_features] integers in [0, 15]
) -> torch.Tensor:  # [in_features // 8, out_features] int32
    """Eight 4-bit values along K per int32, value ``k % 8`` in bits ``4 * (k % 8)`` (the sign bit is just bit 31)."""
    k, n = q.shape
    if k % 8:
        raise ValueError(f"in_features: {k} is not a multiple of 8")
    q = q.to(torch.int64).reshape(k // 8, 8, n)
    shifts = (torch.arange(8, device=q.device, dtype=torch.int64) * 4).view(1, 8, 1)
    packed = (q << shifts).sum(dim=1)  # [k // 8, n] in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(
    packed: torch.Tensor,  # [in_features // 8, out_features] int32
) -> torch.Tensor:  # [in_features, out_features] uint8 in [0, 15]
    k8, n = packed.shape
    shifts = (torch.arange(8, device=packed.device, dtype=torch.int32) * 4).view(1, 8, 1)
    q = (packed.unsqueeze(1) >> shifts) & 0xF  # arithmetic shift; the mask drops the sign extension
    return q.reshape(k8 * 8, n).to(torch.uint8)


def int4_group_size_for(in_features: int, group_size: int = INT4_GROUP_SIZE) -> int:
    """``group_size``, halved until it divides ``in_features`` (SmolLM2's 576 = 9 x 64 gets 64); at least 16,
    the smallest K tile of the GEMM kernel. Raises ValueError naming ``group_size`` when none fits."""
    g = group_size
    while g >= 16 and in_features % g:
        g //= 2
    if g < 16 or g % 16:
        raise ValueError(f"group_size: no multiple of 16 up to {group_size} divides in_features={in_features}")
    return g


def quantize_int4(
    weight: torch.Tensor,  # [out_features, in_features]
    group_size: int,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric group-wise quantization. Returns ``(qweight [K // 8, N] int32, scales
    [K // g, N], zeros [K // g, N])``, scales and zeros in ``dtype`` (default: the weight's). The scale is rounded
    (up) to ``dtype`` before q is computed, so dequantizing with the stored scale is what was rounded against,
    and every weight is within half a step of its dequantized value."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group_size: {group_size} does not divide in_features={k}")
    dtype = dtype or weight.dtype
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    w_min = w.amin(dim=-1, keepdim=True).clamp(max=0.0)  # the range includes 0, so z needs no clipping
    w_max = w.amax(dim=-1, keepdim=True).clamp(min=0.0)
    exact = ((w_max - w_min) / INT4_MAX).clamp(min=_MIN_SCALE)
    scales = exact.to(dtype)
    # Round the stored scale up, never down: 15 steps must still span [min, max], so no value is clipped.
    scales = torch.where(scales.float() < exact, torch.nextafter(scales, torch.full_like(scales, torch.inf)),
                         scales).float()
    zeros = (-w_min / scales).round().clamp(0, INT4_MAX)
    q = (w / scales).round().add(zeros).clamp(0, INT4_MAX)  # [n, groups, g]
    qweight = pack_int4(q.reshape(n, k).t())
    return qweight, scales.squeeze(-1).t().contiguous().to(dtype), zeros.squeeze(-1).t().contiguous().to(dtype)


def dequantize_int4(
    qweight: torch.Tensor,  # [in_features // 8, out_features] int32
    scales: torch.Tensor,  # [in_features // group_size, out_features]
    zeros: torch.Tensor,  # [in_features // group_size, out_features]
) -> torch.Tensor:  # [out_features, in_features] float32
    """``w[n, k] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n]`` in fp32: the kernel's per-element maths."""
    q = unpack_int4(qweight).float()  # [K, N]
    group_size = q.shape[0] // scales.shape[0]
    s = scales.float().repeat_interleave(group_size, dim=0)
    z = zeros.float().repeat_interleave(group_size, dim=0)
    return ((q - z) * s).t()


def int4_linear_reference(
    x: torch.Tensor,  # [num_rows, in_features]
    qweight: torch.Tensor,  # [in_features // 8, out_features] int32
    scales: torch.Tensor,  # [in_features // group_size, out_features]
    zeros: torch.Tensor,  # [in_features // group_size, out_features]
    bias: torch.Tensor | None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features], x.dtype
    """The W4A16 GEMM's maths in plain torch (the oracle of the Triton kernel): weights dequantized in fp32 and
    rounded to the activation dtype (as the kernel feeds the tensor cores), fp32 accumulation."""
    w = dequantize_int4(qweight, scales, zeros).to(x.dtype).float()
    out = x.float() @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class Int4Linear(nn.Module):
    """A projection with group-wise 4-bit weights (see the module docstring for the layout). ``use_triton`` None
    runs the Triton W4A16 kernel on CUDA tensors and the torch reference elsewhere; True forces the kernel (e.g.
    under ``TRITON_INTERPRET=1`` on CPU). Build it from quantized tensors (e.g. an AWQ checkpoint's, converted)
    or with ``from_float``."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None, use_triton: bool | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = qweight.shape[0] * 8, qweight.shape[1]
        self.group_size = self.in_features // scales.shape[0]
        self.register_buffer("qweight", qweight)  # [in_features // 8, out_features] int32
        self.register_buffer("scales", scales)  # [in_features // group_size, out_features]
        self.register_buffer("zeros", zeros)  # [in_features // group_size, out_features]
        self.register_buffer("bias", bias)  # [out_features] or None
        # [cdiv(out_features, 8) * 4] int32, zero between launches: arrival counters of split-K kernel launches
        self.register_buffer("split_counters", _split_counters(self.out_features, qweight.device), persistent=False)
        self.use_triton = use_triton

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int = INT4_GROUP_SIZE,
                   use_triton: bool | None = None) -> Int4Linear:
        """Quantize ``weight [out_features, in_features]`` (round to nearest, ``int4_group_size_for`` groups)."""
        qweight, scales, zeros = quantize_int4(weight, int4_group_size_for(weight.shape[1], group_size))
        return cls(qweight, scales, zeros, None if bias is None else bias.detach().clone(), use_triton)

    def forward(
        self,
        x: torch.Tensor,  # [num_rows, in_features]
    ) -> torch.Tensor:  # [num_rows, out_features]
        use = self.use_triton if self.use_triton is not None else x.is_cuda
        if use:
            from specserve.layers.triton_w4a16 import w4a16_linear  # Triton is imported on the kernel path only
            return w4a16_linear(x, self.qweight, self.scales, self.zeros, self.bias, counters=self.split_counters)
        return int4_linear_reference(x, self.qweight, self.scales, self.zeros, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group_size}"


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``module`` (but the split-K counters): what one forward reads from
    memory at least."""
    tensors = {id(t): t for t in (*module.parameters(), *(b for name, b in module.named_buffers()
                                                         if not name.endswith("split_counters")))}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def fp8_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` with row-wise FP8 scales can run on ``device`` (CUDA sm_89+); CPU runs the
    reference instead."""
    if device.type == "cpu" or not hasattr(torch, "_scaled_mm"):
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return (major, minor) >= (8, 9)

