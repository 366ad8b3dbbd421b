"""Linear layers. On CPU, fp32 weights are pre-packed once into oneDNN's blocked layout: for the small
row counts of decoding (1 to a few dozen tokens) oneDNN's packed GEMM is 2-5x faster than the default
BLAS path on AVX2 machines, and packing costs nothing per step.

A layer may also hold its checkpoint's GGUF blocks (``quant``, see ``layers/quant_cpu.py``): the same
weights in 4 or 8 bits. Decoding steps, which are bound by memory bandwidth on CPU, read those instead;
long prefill chunks, which are bound by arithmetic, keep the fp32 GEMM. ``activation_quant`` ("none" | "q8",
from ``EngineConfig.cpu_activation_quant``) says whether that kernel takes x in float32 or rounded to int8 per
block of 32 (integer dot products; see ``layers/quant_cpu.py`` for the numerics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers.quant_cpu import quant_linear


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


# Row counts up to this use the block-quantized kernel when a layer has one; more rows use fp32.
QUANT_MAX_ROWS = 16


class Linear(nn.Linear):
    """``nn.Linear`` that can switch to a packed CPU weight after loading (``pack()``) and to the
    checkpoint's own quantized blocks for small row counts (``quant``)."""

    packed: torch.Tensor | None = None
    quant: object | None = None  # QuantizedWeight holding exactly ``weight``, in block form
    activation_quant: str = "none"  # "none" | "q8": how ``quant``'s kernel takes x (EngineConfig.cpu_activation_quant)

    def pack(self, batch_hint: int = 8) -> None:
        self.packed = pack_weight(self.weight, batch_hint)

    def forward(
        self,
        x: torch.Tensor,  # [num_rows, in_features]
    ) -> torch.Tensor:  # [num_rows, out_features]
        if self.quant is not None and x.shape[0] <= QUANT_MAX_ROWS:
            return quant_linear(x, self.quant, self.bias, self.activation_quant)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)
