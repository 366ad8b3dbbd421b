"""Quantize a loaded model's projections in place: ``--quantization fp8`` (e4m3 weights with per-channel scales,
per-token activation scales; Micikevicius et al., arXiv 2209.05433) or ``int4`` (weight-only, group-wise,
AWQ-style asymmetric groups of 128; Lin et al., arXiv 2306.00978). Formats and kernels: ``layers/quant_gpu.py``.

By default only the decoder layers' fused projections change (q|k|v, o, gate|up, down): they hold almost all of
a model's weight bytes, and the LM head stays in the model dtype, as vLLM and llm-compressor leave it. With
``lm_head`` (``--quantize-lm-head``) the head is quantized too, into a copy when it is tied to the embedding table
(the table itself stays: lookups read a few rows). That saves the head's share of a decode step's bytes (1 GB of
Llama-3.1-8B's 16 GB in bf16: 0.12 ms a step on an H200 in FP8) at the cost of logits rounded through FP8 or
INT4 weights; the verifier then checks drafts against that quantized model, so speculation stays lossless with
respect to it."""

from __future__ import annotations

import torch
from torch import nn

from specserve.config import QUANTIZATION_METHODS
from specserve.layers.linear import Linear
from specserve.layers.quant_gpu import INT4_GROUP_SIZE, Fp8Linear, Int4Linear, fp8_supported, pack_int4

PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def quantize_weight(
    weight: torch.Tensor,  # [out_features, in_features] bf16 / fp32
    bias: torch.Tensor | None,  # [out_features] or None
    method: str, group_size: int = INT4_GROUP_SIZE, use_kernel: bool | None = None,
) -> nn.Module:
    """``method``'s quantized projection computing ``x @ weight.T (+ bias)`` (a layer's ``Linear`` or the LM head);
    ``use_kernel`` None: the GPU kernel on GPU tensors."""
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    if method == "fp8":
        if use_kernel is None and weight.device.type != "cpu" and not fp8_supported(weight.device):
            raise ValueError(f"quantization: fp8 needs torch._scaled_mm on an sm_89+ GPU; {weight.device} is not one")
        return Fp8Linear.from_float(weight, bias, use_scaled_mm=use_kernel, use_triton=use_kernel)
    if method == "int4":
        return Int4Linear.from_float(weight, bias, group_size, use_triton=use_kernel)
    raise ValueError(f"quantization: unknown method {method!r}; use one of {', '.join(QUANTIZATION_METHODS)}")


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, group_size: int = INT4_GROUP_SIZE,
                   use_kernel: bool | None = None, lm_head: bool = False) -> int:
    """Replace every decoder layer's projections of ``model`` (a ``LlamaForCausalLM``) with ``method``'s
    quantized module, on the device the weights are on; with ``lm_head`` the LM head too
    (``model.quantized_head``, which ``compute_logits`` then runs). Returns the number of projections replaced."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: unknown method {method!r}; use one of {', '.join(QUANTIZATION_METHODS)}")
    if lm_head and model.quantized_head is not None:
        raise ValueError("quantize_lm_head: the LM head is already quantized")
    count = 0
    for layer in model.layers:
        for parent_name, name in PROJECTIONS:
            parent = getattr(layer, parent_name)
            linear = getattr(parent, name)
            if not isinstance(linear, Linear):
                raise ValueError(f"quantization: {parent_name}.{name} is already {type(linear).__name__}")
            setattr(parent, name, quantize_weight(linear.weight, linear.bias, method, group_size, use_kernel))
            count += 1
    if lm_head:
        weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        model.quantized_head = quantize_weight(weight, None, method, group_size, use_kernel)
        if model.lm_head is not None:  # untied: its 16-bit weights go (a tied head is the embedding table)
            model.lm_head = _NoWeights()
        count += 1
    model.quantization = method
    return count


class _NoWeights(nn.Module):
    """Where an untied model's bf16 LM head was before ``quantize_model(lm_head=True)`` freed it: any use of it
    (instead of ``quantized_head``) fails loudly rather than reading freed weights."""

    @property
    def weight(self) -> torch.Tensor:
        raise RuntimeError("the LM head was quantized (model.quantized_head); its 16-bit weights are gone")


# AutoAWQ's "gemm" checkpoints pack 8 output columns per int32 along N, nibble i holding column 8 * c + order[i].
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_awq(
    packed: torch.Tensor,  # [rows, out_features // 8] int32 (AWQ qweight or qzeros)
) -> torch.Tensor:  # [rows, out_features] uint8 in [0, 15]
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * 4
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [rows, out // 8, 8]: nibble i = column order[i]
    columns = torch.empty_like(nibbles)
    columns[..., list(AWQ_PACK_ORDER)] = nibbles
    return columns.reshape(packed.shape[0], -1).to(torch.uint8)


def awq_to_int4(
    qweight: torch.Tensor,  # [in_features, out_features // 8] int32, AWQ layout
    qzeros: torch.Tensor,  # [in_features // group_size, out_features // 8] int32, AWQ layout
    scales: torch.Tensor,  # [in_features // group_size, out_features]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An AWQ (AutoAWQ "gemm" version) linear's tensors in ``Int4Linear``'s layout: ``(qweight [K // 8, N] int32,
    scales [K // g, N], zeros [K // g, N])``. AWQ dequantizes as ``(q - z) * s``, exactly as we do, so the
    conversion only repacks (along K instead of N, natural nibble order) and widens the zero points. Not yet
    wired into the safetensors loader: checked against a packer written from AutoAWQ's, not a real checkpoint."""
    return pack_int4(unpack_awq(qweight)), scales, unpack_awq(qzeros).to(scales.dtype)


def awq_quant_config(hf_config: dict) -> dict | None:
    """The ``quantization_config`` of an AWQ checkpoint's config.json, or None for an unquantized one. Raises
    ValueError naming ``quantization`` for AWQ variants we cannot run (not 4-bit, no zero points, not "gemm")."""
    qc = hf_config.get("quantization_config") or {}
    if str(qc.get("quant_method", "")).lower() != "awq":
        return None
    if int(qc.get("bits", qc.get("w_bit", 4))) != 4 or not qc.get("zero_point", True) \
            or str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"quantization: only 4-bit AWQ 'gemm' checkpoints with zero points are supported, got {qc}")
    return qc


@torch.no_grad()
def load_awq_projections(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype,
                         use_kernel: bool | None = None) -> int:
    """Give every decoder layer of ``model`` ``Int4Linear`` projections made from the AWQ tensors in ``state``
    (HF names ``<proj>.qweight / .qzeros / .scales``; q|k|v and gate|up fused along N as our layers are), and
    pop those tensors from ``state``. ``load_hf_state_dict`` then loads the rest and skips these layers."""
    device = model.embed_tokens.weight.device

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise ValueError(f"checkpoint is missing AWQ tensor {name}")
        return state.pop(name)

    count = 0
    for i, layer in enumerate(model.layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        sources = ([a + "q_proj", a + "k_proj", a + "v_proj"], [a + "o_proj"], [m + "gate_proj", m + "up_proj"],
                   [m + "down_proj"])
        for (parent_name, name), parts in zip(PROJECTIONS, sources):
            converted = [awq_to_int4(take(p + ".qweight"), take(p + ".qzeros"), take(p + ".scales").to(dtype))
                         for p in parts]
            qweight, scales, zeros = (torch.cat([c[j] for c in converted], dim=1).to(device) for j in range(3))
            bias = None
            if all(p + ".bias" in state for p in parts):
                bias = torch.cat([state.pop(p + ".bias") for p in parts]).to(device, dtype)
            setattr(getattr(layer, parent_name), name,
                    Int4Linear(qweight, scales, zeros, bias, use_triton=use_kernel))
            count += 1
    model.quantization = "awq"
    return count
