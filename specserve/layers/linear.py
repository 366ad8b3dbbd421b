"""Linear layers. On CPU, fp32 weights are pre-packed once into oneDNN's blocked layout: for the small
row counts of decoding (1 to a few dozen tokens) oneDNN's packed GEMM is 2-5x faster than the default
BLAS path on AVX2 machines, and packing costs nothing per step.

A layer may also hold its checkpoint's GGUF blocks (``quant``, see ``layers/quant_cpu.py``): the same
weights in 4 or 8 bits. Decoding steps, which are bound by memory bandwidth on CPU, read those instead;
long prefill chunks, which are bound by arithmetic, keep the fp32 GEMM. ``activation_quant`` ("none" | "q8",
from ``EngineConfig.cpu_activation_quant``) says whether that kernel takes x in float32 or rounded to int8 per
block of 32 (integer dot products; see ``layers/quant_cpu.py`` for the numerics); with "q8" the kernel takes
every row count, prefill included.

On CUDA, 16-bit weights can take a Triton GEMV (``layers/triton_gemv.py``) instead of cuBLAS for a few rows:
``dense_linear`` routes ``0 < M <= quant_tiles.BF16_GEMV_MAX_ROWS`` rows of weights of at least
``BF16_GEMV_MIN_WEIGHT`` elements (read at call time; the default is one row, as timed on the H200; 0 keeps
``F.linear`` everywhere). Verify-sized row counts of the weight shapes listed in ``quant_tiles.BF16_GEMM_TILES``
take the Triton tensor-core GEMM (``layers/triton_gemm.py``; empty by default: cuBLAS). ``Linear.forward`` and the
LM head (``LlamaForCausalLM.compute_logits``) call it. A ``Linear`` given an ``LtGemm`` (``layers/cublaslt_gemm.py``:
``quant_tiles.BF16_LT_ALGOS``, measured cuBLASLt configurations for verify-sized row counts) runs those row counts
through it first."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers import quant_tiles
from specserve.layers.quant_cpu import quant_linear

# Devices whose 16-bit GEMMs ``dense_linear`` may send to the Triton GEMV (tests add "cpu" to run it interpreted).
GEMV_DEVICE_TYPES: frozenset[str] = frozenset({"cuda"})


def cpu_packing_supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_weight(weight: torch.Tensor, batch_hint: int = 8) -> torch.Tensor | None:
    """``[out_features, in_features]`` -> oneDNN-packed copy, or None where packing is unavailable."""
    if not cpu_packing_supported(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


def packed_linear(
    x: torch.Tensor,  # [num_rows, in_features]
    packed: torch.Tensor,  # oneDNN-packed [out_features, in_features]
    bias: torch.Tensor | None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def dense_linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
    float_out: bool = False,
) -> torch.Tensor:  # [num_rows, out_features], x.dtype (float32 with float_out)
    """``F.linear``, or the Triton 16-bit GEMV (``triton_gemv.gemv_linear``: fp32 sums, one rounding) for
    ``0 < num_rows <= quant_tiles.BF16_GEMV_MAX_ROWS`` rows on a ``GEMV_DEVICE_TYPES`` device when the weight has
    at least ``quant_tiles.BF16_GEMV_MIN_WEIGHT`` elements and the operands fit it (2D x, contiguous bf16 / fp16
    weight of x's dtype). ``BF16_GEMV_MAX_ROWS = 0`` makes this exactly ``F.linear``. Rows and weight shapes
    with a ``quant_tiles.BF16_GEMM_TILES`` entry (``bf16_gemm_config``) take the Triton tensor-core GEMM
    (``triton_gemm.gemm_linear``) instead of cuBLAS.

    ``float_out`` (the LM head): the result in float32. The GEMV and, on CUDA, cuBLAS (``torch.mm`` with
    ``out_dtype``) write their fp32 sums directly, without the 16-bit rounding and the separate ``.float()``
    pass over ``[num_rows, vocab]`` (at 256 verify rows of a 128k vocabulary that copy took ~0.1 ms on an H200);
    elsewhere ``F.linear(...).float()``."""
    max_rows = quant_tiles.BF16_GEMV_MAX_ROWS
    out_dtype = torch.float32 if float_out else None
    if (max_rows > 0 and x.dim() == 2 and 0 < x.shape[0] <= max_rows and x.device.type in GEMV_DEVICE_TYPES
            and weight.numel() >= quant_tiles.BF16_GEMV_MIN_WEIGHT):
        from specserve.layers import triton_gemv  # lazily: Triton only where it runs
        if triton_gemv.gemv_supported(x, weight, bias):
            return triton_gemv.gemv_linear(x, weight, bias, out_dtype=out_dtype)
    if x.dim() == 2 and x.device.type in GEMV_DEVICE_TYPES and weight.dim() == 2:
        config = quant_tiles.bf16_gemm_config(x.shape[0], weight.shape[0], weight.shape[1])
        if config is not None:
            from specserve.layers import triton_gemm  # lazily: Triton only where it runs
            if triton_gemm.gemm_supported(x, weight, bias):
                return triton_gemm.gemm_linear(x, weight, bias, config=config, out_dtype=out_dtype)
    if not float_out or x.dtype == torch.float32:
        return F.linear(x, weight, bias)
    if x.device.type == "cuda" and x.dim() == 2 and bias is None:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x, weight, bias).float()


# Row counts up to this use the block-quantized kernel when a layer has one; more rows use fp32. With int8
# activations ("q8") every row count uses the kernel: a row's result then never depends on the rows batched with it
# (a prefill chunk, other requests), and at prefill sizes the int8 kernel is no slower than oneDNN's fp32 GEMM.
QUANT_MAX_ROWS = 16


def use_quant_kernel(num_rows: int, activation_quant: str) -> bool:
    """Whether a layer holding GGUF blocks runs ``num_rows`` rows through the block-quantized kernel."""
    return activation_quant == "q8" or num_rows <= QUANT_MAX_ROWS


class Linear(nn.Linear):
    """``nn.Linear`` that can switch to a packed CPU weight after loading (``pack()``) and to the
    checkpoint's own quantized blocks for small row counts (``quant``)."""

    packed: torch.Tensor | None = None
    quant: object | None = None  # QuantizedWeight holding exactly ``weight``, in block form
    activation_quant: str = "none"  # "none" | "q8": how ``quant``'s kernel takes x (EngineConfig.cpu_activation_quant)
    # Row counts up to this take ``quant``'s kernel, more take the fp32 path; None: ``use_quant_kernel``'s rule (a
    # target's layers, whose rows must not depend on the rows beside them). A draft head may pick its own.
    quant_max_rows: int | None = None
    lt: object | None = None  # cublaslt_gemm.LtGemm: a measured cuBLASLt configuration for some row counts (CUDA)

    def pack(self, batch_hint: int = 8) -> None:
        self.packed = pack_weight(self.weight, batch_hint)

    def forward(
        self,
        x: torch.Tensor,  # [num_rows, in_features]
    ) -> torch.Tensor:  # [num_rows, out_features]
        if self.quant is not None and (use_quant_kernel(x.shape[0], self.activation_quant)
                                       if self.quant_max_rows is None else x.shape[0] <= self.quant_max_rows):
            return quant_linear(x, self.quant, self.bias, self.activation_quant)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        if self.lt is not None:
            out = self.lt(x, self.weight)
            if out is not None:
                return out
        return dense_linear(x, self.weight, self.bias)
