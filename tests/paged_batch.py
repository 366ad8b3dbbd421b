"""Random ragged batches over a paged KV cache, and a runner comparing attention backends on them (the torch
reference against the C++ and Triton backends)."""

from __future__ import annotations

import torch

from specserve.layers.attention import AttentionMetadata, build_attention_metadata


def make_batch(gen: torch.Generator, query_lens: list[int], context_lens: list[int], block_size: int,
               num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
               dtype: torch.dtype = torch.float32, spare_blocks: int = 3, fused_qkv: bool = False):
    """Random caches and a ragged batch whose sequences own shuffled, non-contiguous blocks. With ``fused_qkv``,
    q/k/v are views into one fused qkv matrix, as the model passes them (token stride != heads * head_dim)."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in blocks_per_seq:
        tables.append(ids[at:at + n])
        at += n
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, device)
    t = meta.num_tokens
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    if fused_qkv:
        qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(device, dtype)
        q = qkv[:, :num_heads * head_dim].view(t, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(t, num_kv_heads, head_dim)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(t, num_kv_heads, head_dim)
    else:
        q = torch.randn(t, num_heads, head_dim, generator=gen).to(device, dtype)
        k = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    return meta, q, k, v, k_cache, v_cache


def run_backends(backends, meta: AttentionMetadata, q, k, v, k_cache, v_cache, block_size: int):
    """[(out, k_cache, v_cache)] of each backend, each on its own copy of the caches."""
    results = []
    for backend in backends:
        kc, vc = k_cache.clone(), v_cache.clone()
        backend.prepare(meta, block_size)
        out = backend.forward(q, k, v, kc, vc, meta)
        results.append((out, kc, vc))
    return results
