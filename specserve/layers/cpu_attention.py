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

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from specserve.layers.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from specserve.layers.quant_cpu import cpu_has_avx2_fma

logger = logging.getLogger(__name__)

EXTENSION_NAME = "specserve_cpu_paged_attention"
SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "cpu_paged_attention.cpp"


def attention_extension_name() -> str:
    return EXTENSION_NAME + ("_avx2" if cpu_has_avx2_fma() else "_scalar")


def attention_extension_build_dir() -> Path:
    """``$SPECSERVE_CACHE_DIR/torch_extensions/<name>``, else under ``~/.cache/specserve``."""
    from specserve.models.fetch import cache_dir

    return cache_dir() / "torch_extensions" / attention_extension_name()


def build_attention_extension() -> ModuleType:
    """Compile (or load the cached build of) the kernel; raises on failure."""
    from torch.utils.cpp_extension import load

    flags = ["-O3", "-fopenmp"]  # -fopenmp: at::parallel_for is inline and uses torch's OpenMP pool
    if cpu_has_avx2_fma():
        flags += ["-mavx2", "-mfma"]
    build_dir = attention_extension_build_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(name=attention_extension_name(), sources=[str(SOURCE)], extra_cflags=flags,
                extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


@functools.lru_cache(maxsize=1)
def load_attention_extension() -> ModuleType | None:
    """The compiled kernel module (built once per process), or None (logged) when it cannot be built."""
    if os.environ.get("SPECSERVE_DISABLE_ATTENTION_KERNEL"):
        logger.info("CPU paged-attention kernel disabled by $SPECSERVE_DISABLE_ATTENTION_KERNEL")
        return None
    try:
        return build_attention_extension()
    except Exception as exc:  # compiler missing, ninja missing, unsupported platform, ...
        logger.warning("CPU paged-attention kernel unavailable, falling back to the torch backend: %s", exc)
        return None


class CpuPagedAttentionBackend:
    """``AttentionBackend`` for fp32 on CPU: attends straight from the paged cache (no K/V gather, no mask)."""

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
