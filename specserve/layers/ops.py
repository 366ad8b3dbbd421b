"""The handful of elementwise operations a decoder layer needs, behind one small interface:
``TorchOps`` (plain torch, any device, the reference), ``CpuKernelOps`` (our fused C++ kernels,
``layers/cpu_ops.py``) and ``TritonOps`` (one Triton kernel per op on GPU, ``layers/triton_ops.py``), chosen
once when the model is built (``select_ops``)."""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

DISABLE_TRITON_OPS_ENV = "SPECSERVE_DISABLE_TRITON_OPS"


class TorchOps:
    @staticmethod
    def rms_norm(
        x: torch.Tensor,  # [num_tokens, hidden_size]
        weight: torch.Tensor,  # [hidden_size]
        eps: float,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    @classmethod
    def fused_add_rms_norm(
        cls,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor,  # [num_tokens, hidden_size], updated in place: residual += x
        weight: torch.Tensor,  # [hidden_size]
        eps: float,
    ) -> torch.Tensor:  # rms_norm(residual + x)
        residual.add_(x)
        return cls.rms_norm(residual, weight, eps)

    @staticmethod
    def silu_and_mul(
        gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate_size]
    ) -> torch.Tensor:  # [num_tokens, intermediate_size]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rope_(
        qk: torch.Tensor,  # [num_tokens, num_q_heads + num_kv_heads, head_dim], rotated in place
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
    ) -> torch.Tensor:
        half = qk.shape[-1] // 2
        rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        qk.copy_(qk * cos + rotated * sin)
        return qk


class CpuKernelOps(TorchOps):
    """Fused C++ kernels for fp32 on CPU; each replaces several tiny torch ops."""

    def __init__(self) -> None:
        from specserve.layers import cpu_ops
        self._k = cpu_ops

    def rms_norm(self, x, weight, eps):  # noqa: D102 - shapes as in TorchOps
        return self._k.rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        return self._k.fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up):
        return self._k.silu_and_mul(gate_up)

    def rope_(self, qk, cos, sin):
        return self._k.rope_rotate_half_(qk, cos, sin)


def select_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    """Fused CPU kernels for fp32 on CPU when they build; on CUDA the Triton kernels when Triton imports and
    ``SPECSERVE_DISABLE_TRITON_OPS`` is unset; the torch reference otherwise. Triton is imported only here, on
    the CUDA path: CPU runs never load it."""
    if device.type == "cpu" and dtype == torch.float32:
        from specserve.layers.cpu_ops import load_ops_extension
        if load_ops_extension() is not None:
            return CpuKernelOps()
    if device.type == "cuda" and not os.environ.get(DISABLE_TRITON_OPS_ENV):
        try:
            from specserve.layers.triton_ops import TritonOps
        except (ImportError, RuntimeError) as exc:  # not installed, or no usable driver / compiler
            logger.warning("Triton ops unavailable (%s); using the torch reference ops", exc)
        else:
            return TritonOps()
    return TorchOps()
