"""Quantize a loaded model's projections in place: ``--quantization fp8`` (e4m3 weights with per-channel scales,
per-token activation scales; Micikevicius et al., arXiv 2209.05433) or ``int4`` (weight-only, group-wise,
AWQ-style asymmetric groups of 128; Lin et al., arXiv 2306.00978). Formats and kernels: ``layers/quant_gpu.py``.

Only the decoder layers' fused projections change (q|k|v, o, gate|up, down): they hold almost all of a model's
weight bytes. The embedding table and the LM head stay in the model dtype (the head's logits feed the verifier,
and a tied head shares the embedding table)."""

from __future__ import annotations

import torch
from torch import nn

from specserve.config import QUANTIZATION_METHODS
from specserve.layers.linear import Linear
from specserve.layers.quant_gpu import INT4_GROUP_SIZE, Fp8Linear, Int4Linear, fp8_supported

PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def quantize_linear(linear: nn.Linear, method: str, group_size: int = INT4_GROUP_SIZE,
                    use_kernel: bool | None = None) -> nn.Module:
    """The quantized replacement of one bf16/fp32 ``Linear``; ``use_kernel`` None: the GPU kernel on GPU tensors."""
    weight = linear.weight.detach()  # [out_features, in_features]
    bias = None if linear.bias is None else linear.bias.detach()
    if method == "fp8":
        if use_kernel is None and weight.device.type != "cpu" and not fp8_supported(weight.device):
            raise ValueError(f"quantization: fp8 needs torch._scaled_mm on an sm_89+ GPU; {weight.device} is not one")
        return Fp8Linear(weight, bias, use_scaled_mm=use_kernel)
    if method == "int4":
        return Int4Linear(weight, bias, group_size, use_triton=use_kernel)
    raise ValueError(f"quantization: unknown method {method!r}; use one of {', '.join(QUANTIZATION_METHODS)}")


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, group_size: int = INT4_GROUP_SIZE,
                   use_kernel: bool | None = None) -> int:
    """Replace every decoder layer's projections of ``model`` (a ``LlamaForCausalLM``) with ``method``'s
    quantized module, on the device the weights are on. Returns the number of layers replaced."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: unknown method {method!r}; use one of {', '.join(QUANTIZATION_METHODS)}")
    count = 0
    for layer in model.layers:
        for parent_name, name in PROJECTIONS:
            parent = getattr(layer, parent_name)
            linear = getattr(parent, name)
            if not isinstance(linear, Linear):
                raise ValueError(f"quantization: {parent_name}.{name} is already {type(linear).__name__}")
            setattr(parent, name, quantize_linear(linear, method, group_size, use_kernel))
            count += 1
    model.quantization = method
    return count
