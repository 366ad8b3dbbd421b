"""Attention read in place from the paged KV cache on CPU (C++ kernel), fp32.

``TorchAttentionBackend`` gathers every sequence's K/V out of the cache with fancy indexing (a copy per layer)
and runs SDPA with a dense mask; at decode most of that is data movement. ``CpuPagedAttentionBackend`` instead
calls ``specserve/kernels/cpu_paged_attention.cpp``: ``write_kv`` copies the step's K/V rows into their slots
(slot -1 skipped), then ``paged_attention`` walks each sequence's block table directly, with an online softmax
(FlashAttention, Dao et al. 2205.14135) and all query heads of one kv head sharing each K/V row read.

The extension is built on first use with ``torch.utils.cpp_extension`` into the specserve cache, exactly like
the quantized-GEMM kernel (``specserve.layers.quant_cpu``); ``load_attention_extension()`` returns None when it
cannot be built, and ``make_cpu_backend()`` then falls back to ``TorchAttentionBackend``.
"""

from __future__ import annotations

from types import ModuleType

import torch

from specserve.kernels.loader import CpuKernel
from specserve.layers.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend

KERNEL = CpuKernel("specserve_cpu_paged_attention", "cpu_paged_attention.cpp", "SPECSERVE_DISABLE_ATTENTION_KERNEL")
build_attention_extension = KERNEL.build
load_attention_extension = KERNEL.load


class CpuPagedAttentionBackend:
    """``AttentionBackend`` for fp32 on CPU: attends straight from the paged cache (no K/V gather, no mask)."""

    capturable = False

    def __init__(self, ext: ModuleType | None = None) -> None:
        ext = ext if ext is not None else load_attention_extension()
        if ext is None:
            raise RuntimeError("the CPU paged-attention kernel is unavailable (see the log); "
                               "use TorchAttentionBackend instead")
        self._ext = ext

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        # Host lists -> int64 tensors once per step; every layer reuses them.
        meta.extra = {
            "block_size": block_size,
            "seq_lens": torch.tensor(meta.seq_lens, dtype=torch.int64),  # [num_seqs]
            "block_tables": meta.block_tables.to("cpu", torch.int64).contiguous(),  # [num_seqs, max_blocks]
            "query_start_loc": meta.query_start_loc.to("cpu", torch.int64).contiguous(),  # [num_seqs + 1]
            "slot_mapping": meta.slot_mapping.to("cpu", torch.int64).contiguous(),  # [num_tokens]
        }

    def prepare_static(self, meta: AttentionMetadata, block_size: int, seq_lens: torch.Tensor,
                       query_len: int, num_splits: int | None = None) -> None:
        """``prepare()`` from device tensors only (the kernel reads seq_lens as a tensor anyway)."""
        meta.extra = {
            "block_size": block_size,
            "seq_lens": seq_lens.to("cpu", torch.int64),  # [num_seqs]
            "block_tables": meta.block_tables.to("cpu", torch.int64).contiguous(),  # [num_seqs, width]
            "query_start_loc": meta.query_start_loc.to("cpu", torch.int64).contiguous(),  # [num_seqs + 1]
            "slot_mapping": meta.slot_mapping.to("cpu", torch.int64).contiguous(),  # [num_tokens]
        }

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        extra = meta.extra
        assert extra is not None and "seq_lens" in extra, "prepare() must run before forward()"
        for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise TypeError(f"CpuPagedAttentionBackend supports float32 CPU tensors only; {name} is "
                                f"{t.dtype} on {t.device} (use TorchAttentionBackend)")
        if k_cache.shape[1] != extra["block_size"]:
            raise ValueError(f"k_cache block_size {k_cache.shape[1]} != prepare()'s {extra['block_size']}")
        self._ext.write_kv(k, v, k_cache, v_cache, extra["slot_mapping"])
        scale = q.shape[-1] ** -0.5
        return self._ext.paged_attention(q, k_cache, v_cache, extra["block_tables"], extra["seq_lens"],
                                         extra["query_start_loc"], scale)


def make_cpu_backend(dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """The C++ paged backend for fp32 when its extension loads, else the plain-torch reference backend."""
    if dtype == torch.float32:
        ext = load_attention_extension()
        if ext is not None:
            return CpuPagedAttentionBackend(ext)
    return TorchAttentionBackend()
