"""Attention over a paged KV cache: the backend interface and the plain-torch reference backend.

A step's batch is ragged: sequence ``i`` contributes ``query_lens[i]`` new tokens (a prefill chunk, one
decode token, or ``1 + num_spec_tokens`` verify tokens) whose absolute positions are
``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``. New tokens attend causally to everything before them,
cached or new. Tokens are packed back to back:

    query_lens = [3, 1]          seq_lens = [3, 7]
    packed q   = [a0 a1 a2 | b6]  (b's first six positions are already in the cache)

The KV cache of one layer is ``[num_blocks, block_size, num_kv_heads, head_dim]``; slot ``s`` is token
``s % block_size`` of block ``s // block_size``. ``slot_mapping[t] == -1`` marks a padded token whose
K/V must not be written (used by padded CUDA-graph batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Sequences with at most this many new tokens are attended together in one padded batch
# (decode and verify steps); longer prefill chunks are attended one sequence at a time.
MAX_PADDED_QUERY_LEN = 16


# The SDPA implementations our torch attention paths may use. cuDNN's is left out: given an explicit mask it
# plans a cuDNN graph on the host for each new shape, and ragged engine steps and training batches change shape
# all the time (measured on the H200, torch 2.11: ~1.7 ms of host time per call, 55 of a 56 ms SmolLM2 decode
# step at batch 1; benchmarks/profile_gpu.py).
SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa(
    q: torch.Tensor,  # [..., num_heads, q_len, head_dim]
    k: torch.Tensor,  # [..., num_kv_heads, kv_len, head_dim]
    v: torch.Tensor,  # [..., num_kv_heads, kv_len, head_dim]
    attn_mask: torch.Tensor | None = None,  # broadcastable to [..., num_heads, q_len, kv_len] bool, True = attend
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:  # [..., num_heads, q_len, head_dim]
    """``scaled_dot_product_attention`` restricted to ``SDPA_BACKENDS``, with grouped-query heads. With a mask the
    key/value heads are expanded first, so the memory-efficient kernel (which takes masks) can run."""
    group = q.shape[-3] // k.shape[-3]
    with sdpa_kernel(list(SDPA_BACKENDS)):
        if group > 1 and attn_mask is not None:
            k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=group > 1)


@dataclass
class AttentionMetadata:
    """Per-step description of the ragged batch, shared by every layer."""

    num_tokens: int
    query_lens: list[int]  # host copy, [num_seqs]
    seq_lens: list[int]  # host copy, [num_seqs]: cached + new tokens after this step
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64, cumulative query_lens
    # Backend-specific precomputed indices, filled by the backend's prepare().
    extra: dict | None = None


class AttentionBackend(Protocol):
    """What a model layer needs from an attention implementation."""

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Precompute whatever every layer of this step will reuse (runs once per step)."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v into the cache at ``meta.slot_mapping``, then attend. A backend whose ``fuses_rope``
        attribute is True also takes ``rope=(cos, sin)`` (each ``[num_tokens, 1, head_dim]``) and rotates q
        and k in place first, as ``TorchOps.rope_`` would; the layer then skips its own rope op."""

    def prepare_static(self, meta: AttentionMetadata, block_size: int, seq_lens: torch.Tensor,
                       query_len: int, num_splits: int | None = None) -> None:
        """``prepare()`` for a padded uniform batch (every sequence has ``query_len`` tokens), reading only
        device tensors: ``seq_lens`` ``[num_seqs]`` int32, ``meta.block_tables`` of a fixed width, and
        ``meta.slot_mapping`` / ``meta.query_start_loc``; ``meta.seq_lens`` (host) is not read. Output shapes
        and launch grids depend only on (num_seqs, query_len, table width), so a CUDA graph of prepare_static
        + the model's forward replays any step of that shape (``engine/cuda_graphs.py``). A backend whose
        ``capturable`` attribute is True may be captured; the others run this path eagerly only.
        ``num_splits``: key-range splits, pinned for the capture, where the backend splits keys (Triton)."""


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Host lists -> metadata tensors. Slots are derived from the block tables.

    Example (block_size 4): seq_len 6, query_len 2, block table [7, 2] -> positions 4, 5 ->
    slots [2*4 + 0, 2*4 + 1] = [8, 9].
    """
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    max_blocks = max((len(t) for t in block_tables), default=0)
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    cu = [0]
    for q_len in query_lens:
        cu.append(cu[-1] + q_len)
    return AttentionMetadata(
        num_tokens=cu[-1],
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(block_tables), max_blocks),
        query_start_loc=torch.tensor(cu, dtype=torch.int64, device=device),
    )


@dataclass
class _PaddedGroup:
    """Short-query sequences attended as one padded batch."""

    kv_slots: torch.Tensor  # [num_group_seqs, max_seq_len] int64 slot of every key position
    q_index: torch.Tensor  # [num_group_seqs, max_query_len] int64 packed token index (padding -> 0)
    mask: torch.Tensor  # [num_group_seqs, 1, max_query_len, max_seq_len] bool, True = attend
    valid: torch.Tensor  # [num_group_seqs, max_query_len] bool, real (not padded) query rows
    out_index: torch.Tensor  # [num_valid] int64 packed token index of each valid row
    # True when the group is the whole batch and every sequence has the same query length (decode, or a
    # verify step with one num_spec_tokens): packed tokens then reshape to [G, Q] with no gather or scatter.
    uniform: bool = False


@dataclass
class _LongSeq:
    """One long prefill chunk attended on its own."""

    token_start: int
    query_len: int
    context_len: int  # tokens already in the cache before this chunk
    kv_slots: torch.Tensor  # [seq_len] int64


class TorchAttentionBackend:
    """Reference backend in plain torch (any device). It is the oracle the Triton kernels are tested against.
    Not capturable: ``forward`` syncs on the host (which slots to write) and ``prepare`` sizes tensors from
    host lists."""

    capturable = False

    def prepare_static(self, meta: AttentionMetadata, block_size: int, seq_lens: torch.Tensor,
                       query_len: int, num_splits: int | None = None) -> None:
        """Every sequence in one padded group of ``query_len`` queries over keys ``0 .. width * block_size - 1``
        (the whole block table), masked by ``seq_lens`` on the device; no host reads."""
        device = meta.slot_mapping.device
        num_seqs, width = meta.block_tables.shape
        s_lens = seq_lens.to(torch.int64)  # [G]
        kv_pos = torch.arange(width * block_size, device=device)  # [S]
        kv_slots = meta.block_tables[:, kv_pos // block_size] * block_size + kv_pos % block_size  # [G, S]
        q_off = torch.arange(query_len, device=device)  # [Q]
        q_index = meta.query_start_loc[:num_seqs, None] + q_off[None, :]  # [G, Q]
        q_pos = (s_lens - query_len)[:, None] + q_off[None, :]  # [G, Q]
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < s_lens[:, None, None])
        valid = torch.ones((num_seqs, query_len), dtype=torch.bool, device=device)
        group = _PaddedGroup(kv_slots, q_index, mask.unsqueeze(1), valid, q_index.reshape(-1), uniform=True)
        meta.extra = {"group": group, "longs": []}

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        device = meta.slot_mapping.device
        starts = meta.query_start_loc.tolist()
        short = [i for i, q in enumerate(meta.query_lens) if q <= MAX_PADDED_QUERY_LEN]
        long_ = [i for i, q in enumerate(meta.query_lens) if q > MAX_PADDED_QUERY_LEN]
        group = None
        if short:
            idx = torch.tensor(short, dtype=torch.int64, device=device)
            q_lens = torch.tensor([meta.query_lens[i] for i in short], device=device)  # [G]
            s_lens = torch.tensor([meta.seq_lens[i] for i in short], device=device)  # [G]
            starts_t = torch.tensor([starts[i] for i in short], device=device)  # [G]
            max_q, max_s = int(q_lens.max()), int(s_lens.max())
            kv_pos = torch.arange(max_s, device=device)  # [S]
            tables = meta.block_tables[idx]  # [G, max_blocks]
            kv_slots = tables.gather(1, (kv_pos // block_size).clamp(max=tables.shape[1] - 1).expand(len(short), -1))
            kv_slots = kv_slots * block_size + kv_pos % block_size  # [G, S]
            q_off = torch.arange(max_q, device=device)  # [Q]
            valid = q_off[None, :] < q_lens[:, None]  # [G, Q]
            q_index = torch.where(valid, starts_t[:, None] + q_off[None, :], 0)
            q_pos = (s_lens - q_lens)[:, None] + q_off[None, :]  # [G, Q] absolute position of each query
            mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < s_lens[:, None, None])
            uniform = len(short) == len(meta.query_lens) and bool((q_lens == max_q).all())
            group = _PaddedGroup(kv_slots, q_index, mask.unsqueeze(1), valid, q_index[valid], uniform)
        longs = []
        for i in long_:
            s_len, q_len = meta.seq_lens[i], meta.query_lens[i]
            pos = torch.arange(s_len, device=device)
            table = meta.block_tables[i]
            longs.append(_LongSeq(starts[i], q_len, s_len - q_len, table[pos // block_size] * block_size
                                  + pos % block_size))
        meta.extra = {"group": group, "longs": longs}

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        assert meta.extra is not None, "prepare() must run before forward()"
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, kvh, d]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        write = meta.slot_mapping >= 0
        if bool(write.all()):
            k_flat.index_copy_(0, meta.slot_mapping, k)
            v_flat.index_copy_(0, meta.slot_mapping, v)
        else:
            k_flat.index_copy_(0, meta.slot_mapping[write], k[write])
            v_flat.index_copy_(0, meta.slot_mapping[write], v[write])

        out = torch.empty_like(q)
        group: _PaddedGroup | None = meta.extra["group"]
        if group is not None:
            num_seqs, max_q = group.q_index.shape
            if group.uniform:
                qg = q.view(num_seqs, max_q, *q.shape[1:]).transpose(1, 2)  # [G, h, Q, d]
            else:
                qg = q[group.q_index].transpose(1, 2)
            kg = k_flat[group.kv_slots].transpose(1, 2)  # [G, kvh, S, d]
            vg = v_flat[group.kv_slots].transpose(1, 2)
            og = sdpa(qg, kg, vg, attn_mask=group.mask)
            if group.uniform:
                return og.transpose(1, 2).reshape(q.shape)
            out.index_copy_(0, group.out_index, og.transpose(1, 2)[group.valid])
        for seq in meta.extra["longs"]:
            sl = slice(seq.token_start, seq.token_start + seq.query_len)
            qs = q[sl].transpose(0, 1)  # [h, q_len, d]
            if seq.context_len == 0:
                ks, vs = k[sl].transpose(0, 1), v[sl].transpose(0, 1)  # [kvh, q_len, d]
                os_ = sdpa(qs, ks, vs, is_causal=True)
            else:
                ks = k_flat[seq.kv_slots].transpose(0, 1)  # [kvh, seq_len, d]
                vs = v_flat[seq.kv_slots].transpose(0, 1)
                q_pos = seq.context_len + torch.arange(seq.query_len, device=q.device)
                kv_pos = torch.arange(seq.kv_slots.shape[0], device=q.device)
                mask = kv_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
                os_ = sdpa(qs, ks, vs, attn_mask=mask)
            out[sl] = os_.transpose(0, 1)
        return out
