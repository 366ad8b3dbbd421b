"""Rotary position embedding (RoFormer, arXiv 2104.09864) in the rotate-half layout Hugging Face uses.

Supports the plain schedule, linear position interpolation, and Llama 3.x frequency scaling
("rope_type": "llama3"): low-frequency bands are divided by ``factor``, high-frequency bands are kept,
and the bands between are blended smoothly.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies, ``[head_dim // 2]`` float32, with optional scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float()
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_mid, blended, scaled).float()
    raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r}")


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position, computed in fp32 and kept in ``dtype`` (the
    model's activation dtype) side by side in one buffer, so that a step's lookup is one gather kernel (not a
    gather and a cast for each of cos and sin). The values are those of ``cos_fp32[positions].to(dtype)``."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_position, head_dim]
        # [max_position, 2, head_dim]: cos | sin of each position in one row
        self.register_buffer("cos_sin_cached", torch.stack([emb.cos(), emb.sin()], dim=1).to(dtype),
                             persistent=False)

    def cos_sin(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_tokens, 1, head_dim], views with row stride 2 * head_dim
        """Look the step's positions up once; every layer reuses the result."""
        rows = self.cos_sin_cached[positions]  # [num_tokens, 2, head_dim]
        if rows.dtype != dtype:  # a caller in another dtype than the tables' (e.g. fp32 tables, autocast bf16)
            rows = rows.to(dtype)
        return rows[:, 0:1], rows[:, 1:2]
