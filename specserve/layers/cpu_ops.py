"""Fused float32 elementwise ops for the CPU decoder layer: RMSNorm, residual add + RMSNorm, SiLU-and-mul, RoPE.

At decode batch sizes (a few rows of hidden 576) each plain torch op costs its dispatch, a temporary and an OpenMP
fork/join, not its arithmetic: a layer's ~10 small ops added ~20 ms to a 90 ms SmolLM2-135M step. The C++ kernels in
``specserve/kernels/cpu_ops.cpp`` do each pattern in one pass (AVX2 where the CPU has it) and use threads only for
large inputs. ``load_ops_extension()`` builds them on first use (into the specserve cache, like
``specserve.layers.quant_cpu``) and returns None when the build fails; the functions here raise in that case, so
callers check ``load_ops_extension() is not None`` once and keep the torch ops otherwise.

Numerics are torch's float32 expressions (RMSNorm: Zhang & Sennrich, arXiv 1910.07467; RoPE in the Hugging Face
rotate-half layout: RoFormer, arXiv 2104.09864), to ~1e-7 relative (only the sum of squares and exp round differently).
"""

from __future__ import annotations

from types import ModuleType

import torch

from specserve.kernels.loader import CpuKernel

KERNEL = CpuKernel("specserve_cpu_ops", "cpu_ops.cpp", "SPECSERVE_DISABLE_CPU_OPS",
                   # no silent a*b+c -> fma, so mul/add chains round as torch's separate ops do
                   extra_cflags=("-ffp-contract=off",))
build_ops_extension = KERNEL.build
load_ops_extension = KERNEL.load


def _ext() -> ModuleType:
    ext = load_ops_extension()
    if ext is None:
        raise RuntimeError("the fused CPU ops extension is unavailable (see the log); use the torch ops instead")
    return ext


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size] float32 (any leading dims)
    weight: torch.Tensor,  # [hidden_size] float32
    eps: float,
) -> torch.Tensor:  # like x, contiguous
    """``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight``."""
    if x.dim() == 2:  # the decode path: skip reshape/view, each a few microseconds of Python here
        return _ext().rms_norm(x, weight, eps)
    lead = x.shape[:-1]
    out = _ext().rms_norm(x.reshape(-1, x.shape[-1]), weight, eps)
    return out.view(*lead, x.shape[-1])


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size] float32 (any leading dims)
    residual: torch.Tensor,  # like x; updated in place: residual += x
    weight: torch.Tensor,  # [hidden_size] float32
    eps: float,
) -> torch.Tensor:  # rms_norm(residual + x), contiguous
    """The pre-norm decoder step ``residual += x; return rms_norm(residual)`` in one pass."""
    if x.dim() == 2:  # shapes are checked in C++
        return _ext().fused_add_rms_norm(x, residual, weight, eps)
    if x.shape != residual.shape:
        raise ValueError(f"fused_add_rms_norm: x {list(x.shape)} and residual {list(residual.shape)} differ")
    hidden = x.shape[-1]
    out = _ext().fused_add_rms_norm(x.reshape(-1, hidden), residual.view(-1, hidden), weight, eps)
    return out.view(*x.shape)


def silu_and_mul(
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate_size] float32: gate columns, then up columns
) -> torch.Tensor:  # [num_tokens, intermediate_size]
    """``F.silu(gate_up[..., :F]) * gate_up[..., F:]``."""
    if gate_up.dim() == 2:
        return _ext().silu_and_mul(gate_up)
    lead = gate_up.shape[:-1]
    out = _ext().silu_and_mul(gate_up.reshape(-1, gate_up.shape[-1]))
    return out.view(*lead, gate_up.shape[-1] // 2)


def rope_rotate_half_(
    qk: torch.Tensor,  # [num_tokens, num_heads_total, head_dim] float32, may be a strided view; updated in place
    cos: torch.Tensor,  # [num_tokens, head_dim] (or [num_tokens, 1, head_dim])
    sin: torch.Tensor,  # like cos
) -> torch.Tensor:  # qk
    """``qk = qk * cos + rotate_half(qk) * sin`` in place; rotate_half(x) = cat(-x[D/2:], x[:D/2])."""
    if cos.dim() == 3:
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    _ext().rope_rotate_half_(qk, cos, sin)
    return qk
