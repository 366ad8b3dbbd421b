"""Attention read in place from the paged KV cache on GPU: Triton kernels behind ``TritonAttentionBackend``.

Three kernels per layer and step, all launched from ``forward`` without a host sync (every launch decision
uses host integers that ``prepare`` computed once per step), so a fixed-shape step can be captured in a CUDA
graph:

1. ``_write_kv_kernel`` copies the step's K/V rows into their cache slots; slot ``-1`` (a padded token of a
   padded CUDA-graph batch) is skipped. When the layer hands over its rotary tables (``forward(..., rope=...)``,
   ``fuses_rope``), ``_rope_write_kv_kernel`` runs instead: it also rotates q and k in place, so the layer's
   separate rope launch goes (one launch fewer per layer and step).
2. ``_decode_kernel`` attends the short sequences (``query_len <= MAX_PADDED_QUERY_LEN``: decode, and verify
   of up to 15 drafts). One program per (sequence, kv head) holds every query token of the sequence times
   every query head of the kv head's group as the rows of one tile, so each K/V tile read from the cache
   serves the whole GQA group. It walks the sequence's block table with an online softmax in fp32
   (flash-decoding). With ``num_splits > 1`` the key range is cut into that many pieces, each its own program
   writing a partial result and its log-sum-exp, and ``_combine_splits_kernel`` merges them (more programs
   in flight for a small batch of long sequences). Merging inside ``_decode_kernel`` instead (the last split of
   a (sequence, kv head) to finish, counted in by an atomic arrival counter, merging the splits in a loop) was
   slower on an H200 wherever it applied (benchmarks/results/split_merge_ab_h200.json: bf16 decode b1 4.17 ->
   4.31 ms, SmolLM2 c1 1014 -> 873 tok/s): its merge waits on one round trip per split, the combine launch on
   one in all, so it was removed.
3. ``_prefill_kernel`` attends the long chunks (chunked prefill: context from earlier chunks may already sit
   in the cache). One program per (tile of query tokens, kv head), keys read from the paged cache up to the
   tile's last query position, causal mask within the chunk.

The online softmax and tiling follow FlashAttention-2 (Dao, arXiv 2307.08691); addressing keys through a block
table follows PagedAttention (Kwon et al., arXiv 2309.06180). Softmax runs in base 2: scores are scaled by
``head_dim ** -0.5 * log2(e)`` and exponentiated with ``exp2``, which is the same softmax.

Row layout of a query tile (token-major, head-minor), with GROUP = num_heads // num_kv_heads = 3:

    rows    r = 0  1  2  3  4  5  6  7 ...
    token   t = 0  0  0  1  1  1  2  2 ...        t = r // GROUP  (query token within the tile)
    head      = 3h 3h+1 3h+2 3h 3h+1 3h+2 ...      head = kv_head * GROUP + r % GROUP

Rows past the tile's last real token are padding: they compute on zeros and are never stored.

On CPU the same kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is
imported); that is how the unit tests check them against ``TorchAttentionBackend``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.layers.attention import MAX_PADDED_QUERY_LEN, AttentionMetadata
from specserve.layers.ops import TorchOps
from specserve.layers.triton_pdl import pdl_args, pdl_begin
from specserve.layers.triton_rope import rope_block_heads, rope_cos_sin, rope_rotate_, rope_tables_match

LOG2E = 1.4426950408889634
# Query tokens per prefill program, by GQA group size: tiles of about 64 rows (tokens x group heads).
PREFILL_TILE_TOKENS = (16, 32, 64)
# Fewest keys worth a split of their own when num_splits is chosen automatically.
MIN_KEYS_PER_SPLIT = 256
# Keys per decode tile for heads of 128 or more and for unsplit decode steps (TritonAttentionBackend.decode_tile_keys)
DECODE_BLOCK_N_WIDE_HEADS = 128
# Cap on automatic split counts. Whole Llama-3.1-8B-shape forwards on the H200 with 32 splits instead (batch 1 / 4 /
# 8, contexts 512 / 2048 / 8192; benchmarks/results/decode_splits_ab_gpu.json): x0.94-0.996 at 512 and 2048, x0.99
# at batch 1 and 8192, x1.015 / x1.036 only at batch 4 / 8 and 8192, so the cap stays. Fewer splits or narrower
# tiles at short context did not pay either (H100, whole bf16 forwards, benchmarks/results/
# decode_tiles_ab_llama_h100.json): against the graph's 16 splits of 128-key tiles at batch 1 / 8, contexts 512 /
# 2048, 2 / 4 / 8 splits x0.93-1.01 and 32 / 64-key tiles x0.99-1.01.
MAX_AUTO_SPLITS = 16
# When the (sequence, kv head) programs of a decode step are fewer than the SMs, automatic split counts aim at
# this many (sequence, kv head, split) programs per SM; with at least one per SM, no split. Timed on the H200
# (benchmarks/results/attention_sweep_gpu.json, KV streamed from HBM, per layer): Llama-3.1-8B shape at batch 8,
# 8 splits 11.9 / 25.0 / 72.4 us at contexts 512 / 2048 / 8192 against 13.6 / 33.1 / 97.6 with the 2 of one program
# per SM; batch 16, 4 splits 16.9 / 41.6 / 130.4 against 18.6 / 54.5 / 187.6 unsplit; SmolLM2 shape at batch 32,
# 4 or 8 splits 10.3-10.7 / 21.4-22.7 at 512 / 2048 against 12.8 / 37.6 unsplit. At Llama batch 32 (256 programs)
# splits only cost (8-token verify rows: 43.8 us with 2 against 30.4).
DECODE_SPLIT_WAVES = 4
# Key tiles in flight per decode program (Triton's num_stages for the decode kernel's loop).
DECODE_STAGES = 2


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prefill_tile_tokens(group: int) -> int:
    """Query tokens per prefill tile for a GQA group size: 64 // group rounded down to a power of two, in
    [16, 64] (group 1 -> 64, 2 -> 32, 3 -> 16 (48 rows, padded to 64), 4 -> 16, 8 -> 16 (128 rows))."""
    tokens = 1 << max(0, (64 // group).bit_length() - 1) if group <= 64 else 1
    return min(max(tokens, PREFILL_TILE_TOKENS[0]), PREFILL_TILE_TOKENS[-1])


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padded token, not written
    stride_kt, stride_kh,  # k strides (token, head); head_dim is contiguous
    stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot in block, head), shared by k and v caches
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    pdl_begin(USE_PDL)
    # One program per token: its [num_kv_heads, head_dim] K and V rows go to one cache slot.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    h = tl.arange(0, KV_HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim) & (slot >= 0)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + tok * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place and written to the cache
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_ptr,  # [num_tokens, 1, head_dim], row stride stride_cos, last dim contiguous
    sin_ptr,  # [num_tokens, 1, head_dim], row stride stride_sin, last dim contiguous
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padded token, not written
    stride_qt, stride_qh,  # q strides (token, head); head_dim is contiguous
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_cos, stride_sin,
    stride_cb, stride_cs, stride_ch,  # cache strides (block, slot in block, head), shared by k and v caches
    num_heads, num_kv_heads,
    HALF: tl.constexpr,  # head_dim // 2
    HALF_PAD: tl.constexpr,  # next power of two >= HALF
    BLOCK_H: tl.constexpr,  # query heads per program
    KV_HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    """The rope op and ``_write_kv_kernel`` in one launch (``TritonAttentionBackend.forward(..., rope=...)``).

    Grid (num_tokens, 1 + cdiv(num_heads, BLOCK_H)). Program (t, 0) rotates token t's K heads, stores them back
    and into the token's cache slot, and copies its V heads there; program (t, j >= 1) rotates query heads
    [(j - 1) * BLOCK_H, j * BLOCK_H) in place. Roundings as ``TorchOps.rope_`` (``triton_rope``)."""
    pdl_begin(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    dims = tl.arange(0, HALF_PAD)[None, :]
    cs = rope_cos_sin(cos_ptr + tok * stride_cos, sin_ptr + tok * stride_sin, HALF, HALF_PAD)
    # (the two branches name their tensors apart: Triton merges same-named values of an if / else)
    if blk == 0:
        slot = tl.load(slot_mapping_ptr + tok)
        h = tl.arange(0, KV_HEADS_PAD)[:, None]
        kv_mask = (h < num_kv_heads) & (dims < HALF)
        k1_ptr = k_ptr + tok * stride_kt + h * stride_kh + dims
        k1, k2 = rope_rotate_(k1_ptr, kv_mask, cs, HALF)
        v1_ptr = v_ptr + tok * stride_vt + h * stride_vh + dims
        v1 = tl.load(v1_ptr, mask=kv_mask)
        v2 = tl.load(v1_ptr + HALF, mask=kv_mask)
        written = kv_mask & (slot >= 0)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + dims
        tl.store(k_cache_ptr + dst, k1, mask=written)
        tl.store(k_cache_ptr + dst + HALF, k2, mask=written)
        tl.store(v_cache_ptr + dst, v1, mask=written)
        tl.store(v_cache_ptr + dst + HALF, v2, mask=written)
    else:
        heads = (blk - 1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        q_mask = (heads < num_heads) & (dims < HALF)
        q1_ptr = q_ptr + tok * stride_qt + heads * stride_qh + dims
        rope_rotate_(q1_ptr, q_mask, cs, HALF)


@triton.jit
def _attend_key_tiles(
    q,  # [BLOCK_M, HEAD_DIM_PAD] query rows of the tile (padding rows are zeros)
    q_pos,  # [BLOCK_M] int absolute position of each row's query token
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    table_ptr,  # [max_blocks] this sequence's row of block_tables
    kv_head,
    tile_lo, tile_hi,  # key tiles [tile_lo, tile_hi) of BLOCK_N positions each
    kv_len,  # keys at positions >= kv_len are never read
    stride_cb, stride_cs, stride_ch,
    head_dim, qk_scale,  # qk_scale = head_dim ** -0.5 * log2(e)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over key tiles -> (acc [BLOCK_M, HEAD_DIM_PAD] unnormalised fp32, m [BLOCK_M] running
    max in log2 units, l [BLOCK_M] running sum of exp2(score - m)). A row that saw no key has m = -inf, l = 0.

    Key position -> cache address, block_size 4, block table [7, 2, 5]: position 9 is token 9 % 4 = 1 of
    logical block 9 // 4 = 2, i.e. physical block table[2] = 5, slot 5 * 4 + 1 = 21."""
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < head_dim
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        key_valid = pos < kv_len
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        offs = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch  # [BLOCK_N]
        kv_mask = key_valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        attend = key_valid[None, :] & (pos[None, :] <= q_pos[:, None])  # causal
        s = tl.where(attend, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no visible key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_safe)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int64
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int64
    seq_ids_ptr,  # [num_short_seqs] int32 the sequences this launch attends
    split_out_ptr,  # [num_tokens, num_heads, num_splits, head_dim] fp32 (SPLIT only)
    split_lse_ptr,  # [num_tokens, num_heads, num_splits] fp32 log2-sum-exp2 (SPLIT only)
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    num_heads, num_splits, head_dim, qk_scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    pdl_begin(USE_PDL)
    # grid: (num_short_seqs, num_kv_heads, num_splits)
    seq = tl.load(seq_ids_ptr + tl.program_id(0)).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    tok_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - tok_start
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    t = rows // GROUP  # query token of each row (see the module docstring)
    head = kv_head * GROUP + rows % GROUP
    row_valid = t < q_len
    q_pos = seq_len - q_len + t  # padding rows land past seq_len: they see every key, never NaN
    d = tl.arange(0, HEAD_DIM_PAD)
    io_mask = row_valid[:, None] & (d < head_dim)[None, :]
    tok = tok_start + t  # [BLOCK_M] packed token index
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask,
                other=0.0)

    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    if SPLIT:
        # Split s covers key tiles [s * per_split, (s + 1) * per_split); e.g. 10 tiles, 4 splits -> 3, 3, 3, 1.
        per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles
    acc, m_i, l_i = _attend_key_tiles(
        q, q_pos, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, kv_head, tile_lo, tile_hi,
        seq_len, stride_cb, stride_cs, stride_ch, head_dim, qk_scale,
        BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM_PAD, DOT_PRECISION)

    if SPLIT:
        # Normalised partial output and its log2-sum-exp2; an empty split has lse = -inf and weight 0.
        has_keys = l_i > 0
        o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        row = (tok * num_heads + head) * num_splits + split  # [BLOCK_M] flat index of (token, head, split)
        tl.store(split_out_ptr + row[:, None] * head_dim + d[None, :], o, mask=io_mask)
        tl.store(split_lse_ptr + row, lse, mask=row_valid)
    else:
        o = acc / l_i[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    split_out_ptr,  # [num_tokens, num_heads, num_splits, head_dim] fp32, each split's normalised output
    split_lse_ptr,  # [num_tokens, num_heads, num_splits] fp32, each split's log2-sum-exp2 (-inf: no keys)
    query_start_loc_ptr,  # [num_seqs + 1] int64
    seq_ids_ptr,  # [num_short_seqs] int32
    stride_ot, stride_oh,
    num_heads, num_splits, head_dim,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    pdl_begin(USE_PDL)
    # grid: (num_short_seqs, num_heads, the longest short query): one (token, head) row per program, all of its
    # splits in one load (no loop: every load is in flight at once, so the launch costs one memory round trip).
    # out = sum_s 2^(lse_s - m) * o_s / sum_s 2^(lse_s - m), m = max_s lse_s (empty splits weigh 0).
    seq = tl.load(seq_ids_ptr + tl.program_id(0)).to(tl.int64)
    head = tl.program_id(1)
    t = tl.program_id(2)
    tok_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - tok_start
    if t < q_len:
        tok = tok_start + t
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_DIM_PAD)
        s_mask = s < num_splits
        d_mask = d < head_dim
        base = (tok * num_heads + head) * num_splits  # flat index of (token, head, split 0)
        lse = tl.load(split_lse_ptr + base + s, mask=s_mask, other=float("-inf"))  # [SPLITS_PAD]
        o = tl.load(split_out_ptr + (base + s)[:, None] * head_dim + d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                    other=0.0)  # [SPLITS_PAD, HEAD_DIM_PAD]
        m = tl.max(lse, axis=0)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # [SPLITS_PAD]; 0 where a split saw no key
        total = tl.sum(w, axis=0)
        o = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # [HEAD_DIM_PAD]
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int64
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int64
    tile_seq_ptr,  # [num_tiles] int32 sequence of each query tile
    tile_first_ptr,  # [num_tiles] int32 first query token of each tile, counted within its sequence's chunk
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    head_dim, qk_scale,
    GROUP: tl.constexpr,
    TILE_TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl)
):
    pdl_begin(USE_PDL)
    # grid: (num_tiles, num_kv_heads). Example: chunk of 40 tokens after 100 cached ones, TILE_TOKENS 16 ->
    # tiles first = 0, 16, 32; the tile at 16 holds positions 116..131 and reads keys 0..131 from the cache.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    first = tl.load(tile_first_ptr + tile)
    tok_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - tok_start
    context_len = tl.load(seq_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    t = first + rows // GROUP  # query token of each row within the chunk
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows // GROUP < TILE_TOKENS) & (t < q_len)
    q_pos = context_len + t
    d = tl.arange(0, HEAD_DIM_PAD)
    io_mask = row_valid[:, None] & (d < head_dim)[None, :]
    tok = tok_start + t
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask,
                other=0.0)
    kv_end = context_len + tl.minimum(first + TILE_TOKENS, q_len)  # one past the tile's last query position
    acc, m_i, l_i = _attend_key_tiles(
        q, q_pos, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, kv_head, 0,
        tl.cdiv(kv_end, BLOCK_N), kv_end, stride_cb, stride_cs, stride_ch, head_dim, qk_scale,
        BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM_PAD, DOT_PRECISION)
    o = acc / l_i[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def auto_splits(programs: int, sms: int) -> int:
    """Split-KV count for ``programs`` (sequence, kv head) decode programs on ``sms`` multiprocessors: 1 when they
    cover the SMs, else ``DECODE_SPLIT_WAVES`` programs per SM, at most ``MAX_AUTO_SPLITS``."""
    if programs >= sms:
        return 1
    return max(1, min(MAX_AUTO_SPLITS, DECODE_SPLIT_WAVES * sms // max(programs, 1)))


def _num_warps(block_m: int, head_dim_pad: int) -> int:
    return 4 if block_m * head_dim_pad <= 64 * 128 else 8


class TritonAttentionBackend:
    """``AttentionBackend`` on GPU: Triton kernels reading K/V in place from the paged cache.

    ``num_splits``: key-range splits per short sequence in ``_decode_kernel``. ``None`` picks a value per step
    from the batch (more splits when few (sequence, kv head) programs would leave SMs idle and sequences are
    long); an integer fixes it, which a CUDA-graph runner should do so that a captured step keeps its launch
    grid. ``block_n``: keys per tile (a power of two, at least 16); ``decode_block_n`` overrides it for the decode
    kernel (default: ``decode_tile_keys``). ``decode_warps``: warps per decode program (None: 4, or 8 for query
    tiles over 64 x 128). ``decode_stages``: key tiles in flight per decode program (``DECODE_STAGES``).

    For CUDA graphs, ``prepare_static`` builds the same index set from device tensors of a fixed shape (a padded
    uniform batch, see ``engine/cuda_graphs.py``) and pins the step's ``num_splits``."""

    capturable = True
    fuses_rope = True  # forward(..., rope=(cos, sin)) rotates q and k in the cache-write launch

    def __init__(self, num_splits: int | None = None, block_n: int = 64, decode_warps: int | None = None,
                 decode_block_n: int | None = None, decode_stages: int = DECODE_STAGES) -> None:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        if block_n < 16 or block_n & (block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
        if decode_warps is not None and decode_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"decode_warps must be a power of two in [1, 16], got {decode_warps}")
        self.num_splits = num_splits
        self.block_n = block_n
        self.decode_warps = decode_warps  # warps of a _decode_kernel program (None: by tile size)
        if decode_block_n is not None and (decode_block_n < 16 or decode_block_n & (decode_block_n - 1)):
            raise ValueError(f"decode_block_n must be a power of two >= 16, got {decode_block_n}")
        self.decode_block_n = decode_block_n
        if decode_stages < 1:
            raise ValueError(f"decode_stages must be >= 1, got {decode_stages}")
        self.decode_stages = decode_stages  # software-pipelining depth of the decode kernel's key-tile loads

    def decode_tile_keys(self, head_dim_pad: int, num_splits: int = 1) -> int:
        """Keys per tile of the decode kernel: ``decode_block_n``, else ``DECODE_BLOCK_N_WIDE_HEADS`` (128) for
        heads of 128 or more, and for narrower heads when the kernel runs unsplit (``num_splits`` 1), else
        ``block_n``.

        Timed on the H200. Heads of 128 (benchmarks/results/attention_tiles_gpu.json: Llama-3.1-8B shape, one
        layer, CUDA graph): 11.9 vs 13.0 us at batch 1, 28.0 vs 30.0 at batch 32, 31.9 vs 33.6 for 8-token verify
        rows. 64-wide heads, whole forwards (CUDA graphs) on the SmolLM2 shape (benchmarks/decode_tiles_ab_gpu.py,
        benchmarks/results/decode_tiles_ab_gpu*.json, three runs): unsplit (batch 48 and more, where one program
        per sequence and kv head already covers the SMs) 128 keys were x1.03-1.31 faster than 64 at contexts
        512-4096; split (batch <= 32) they lost up to 6% at context 512 and gained 3-8% at 2048-4096, so split
        steps keep ``block_n``. Against the rule before (64 everywhere), this one is x1.06-1.31 at batch 48-128 and
        the same at batch <= 32 (``decode_tiles_ab_gpu_rule.json``)."""
        if self.decode_block_n is not None:
            return self.decode_block_n
        return DECODE_BLOCK_N_WIDE_HEADS if head_dim_pad >= 128 or num_splits == 1 else self.block_n

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Host lists -> the kernels' index tensors, in one host-to-device copy per step.

        Example: query_lens [1, 40, 3], seq_lens [9, 140, 20] -> short (decode/verify) sequences [0, 2];
        prefill tiles of 16 tokens for sequence 1: (seq 1, first 0), (1, 16), (1, 32)."""
        device = meta.slot_mapping.device
        query_lens, seq_lens = meta.query_lens, meta.seq_lens
        num_seqs = len(query_lens)
        short = [i for i, n in enumerate(query_lens) if 0 < n <= MAX_PADDED_QUERY_LEN]
        long_ = [i for i, n in enumerate(query_lens) if n > MAX_PADDED_QUERY_LEN]
        packed = list(seq_lens) + short  # int32: seq_lens | short seq ids | per tile size: tile seqs | tile firsts
        tile_counts = {}
        for tokens in PREFILL_TILE_TOKENS:
            firsts = [(i, f) for i in long_ for f in range(0, query_lens[i], tokens)]
            tile_counts[tokens] = len(firsts)
            packed += [i for i, _ in firsts] + [f for _, f in firsts]
        index = torch.tensor(packed, dtype=torch.int32).to(device)
        at = num_seqs + len(short)
        tiles = {}
        for tokens in PREFILL_TILE_TOKENS:
            n = tile_counts[tokens]
            tiles[tokens] = (n, index[at:at + n], index[at + n:at + 2 * n])
            at += 2 * n
        meta.extra = {
            "backend": "triton",
            "block_size": block_size,
            "seq_lens": index[:num_seqs],  # [num_seqs] int32
            "block_tables": meta.block_tables.contiguous(),  # [num_seqs, max_blocks] int64
            "query_start_loc": meta.query_start_loc.contiguous(),  # [num_seqs + 1] int64
            "slot_mapping": meta.slot_mapping.contiguous(),  # [num_tokens] int64
            "short_seq_ids": index[num_seqs:num_seqs + len(short)],  # [num_short] int32
            "num_short": len(short),
            "max_short_query_len": max((query_lens[i] for i in short), default=0),
            "max_short_seq_len": max((seq_lens[i] for i in short), default=0),
            "prefill_tiles": tiles,  # tokens per tile -> (num_tiles, tile seqs [num_tiles], firsts [num_tiles])
        }

    def prepare_static(self, meta: AttentionMetadata, block_size: int, seq_lens: torch.Tensor,
                       query_len: int, num_splits: int | None = None) -> None:
        """``prepare()`` without host data, for capture: every one of the ``num_seqs`` rows of the fixed-width
        ``meta.block_tables`` is a short sequence of ``query_len`` tokens; ``seq_lens`` is ``[num_seqs]`` int32
        on the device. ``num_splits`` (default: the constructor's, else 1) is fixed for the graph's lifetime;
        with splits the decode kernel covers ``cdiv(num_tiles, num_splits)`` key tiles per split, read from
        the device seq_len, so any context length replays correctly (short ones leave splits empty)."""
        if not 1 <= query_len <= MAX_PADDED_QUERY_LEN:
            raise ValueError(f"query_len must be in [1, {MAX_PADDED_QUERY_LEN}] for a static batch, got {query_len}")
        num_seqs = meta.block_tables.shape[0]
        device = meta.slot_mapping.device
        empty = torch.empty(0, dtype=torch.int32, device=device)
        meta.extra = {
            "backend": "triton",
            "block_size": block_size,
            "seq_lens": seq_lens,  # [num_seqs] int32
            "block_tables": meta.block_tables,  # [num_seqs, width] int64, contiguous
            "query_start_loc": meta.query_start_loc,  # [num_seqs + 1] int64
            "slot_mapping": meta.slot_mapping,  # [num_tokens] int64, -1 on padded rows
            "short_seq_ids": torch.arange(num_seqs, dtype=torch.int32, device=device),  # [num_seqs] int32
            "num_short": num_seqs,
            "max_short_query_len": query_len,
            "max_short_seq_len": None,  # unknown on the host: decode_splits() uses "num_splits" below
            "num_splits": num_splits or self.num_splits or 1,
            "prefill_tiles": {tokens: (0, empty, empty) for tokens in PREFILL_TILE_TOKENS},
        }
        for name in ("block_tables", "query_start_loc", "slot_mapping", "seq_lens"):
            if not meta.extra[name].is_contiguous():
                raise ValueError(f"prepare_static: {name} must be contiguous")

    def graph_num_splits(self, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
        """Splits for a captured step of ``num_seqs`` sequences when none is configured (``auto_splits``). The
        context length is not known at capture; a short context leaves splits empty, which exit after a few
        instructions. Example, 132 SMs, 8 kv heads: batch 1 -> 16 splits (capped), 4 -> 16, 8 -> 8, 16 -> 4,
        17 and more -> 1 (the unsplit programs already cover the SMs)."""
        if self.num_splits is not None:
            return self.num_splits
        if device.type != "cuda":  # the interpreter (tests): no SMs to fill
            return 1
        return auto_splits(num_seqs * num_kv_heads, _sm_count(device))

    def decode_splits(self, meta: AttentionMetadata, num_kv_heads: int, device: torch.device) -> int:
        """Key-range splits for this step's short sequences (host arithmetic only)."""
        extra = meta.extra
        if "num_splits" in extra:  # pinned by prepare_static()
            return extra["num_splits"]
        if self.num_splits is not None:
            return self.num_splits
        if device.type != "cuda" or extra["num_short"] == 0:
            return 1
        by_length = extra["max_short_seq_len"] // MIN_KEYS_PER_SPLIT
        return max(1, min(auto_splits(extra["num_short"] * num_kv_heads, _sm_count(device)), by_length))

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # (cos, sin), each [num_tokens, 1, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v into the cache at ``meta.slot_mapping``, then attend. With ``rope``, q and k are rotated
        first (in place, as ``TorchOps.rope_`` rotates them), in the same launch as the cache write where the
        layouts allow (``fuses_rope``)."""
        extra = meta.extra
        assert extra is not None and extra.get("backend") == "triton", "prepare() must run before forward()"
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        block_size = k_cache.shape[1]
        if block_size != extra["block_size"]:
            raise ValueError(f"k_cache block_size {block_size} != prepare()'s {extra['block_size']}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
            raise ValueError("k_cache and v_cache must have the same shape and strides")
        for name, x in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
            if x.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in head_dim (stride {x.stride()})")
            if x.dtype != q.dtype:
                raise TypeError(f"{name} is {x.dtype}, q is {q.dtype}")
        group = num_heads // num_kv_heads
        head_dim_pad = max(16, _next_pow2(head_dim))
        qk_scale = head_dim ** -0.5 * LOG2E
        # fp32 is checked against the reference to 1e-5: no TF32 rounding inside tl.dot.
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if num_tokens == 0:
            return out

        if rope is not None and not rope_tables_match(q, *rope):
            TorchOps.rope_(q, *rope)  # the torch reference on layouts the fused kernel does not take
            TorchOps.rope_(k, *rope)
            rope = None
        if rope is None:
            _write_kv_kernel[(num_tokens,)](
                k, v, k_cache, v_cache, extra["slot_mapping"], k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                *cache_strides, num_kv_heads, head_dim,
                BLOCK_SIZE=block_size, KV_HEADS_PAD=_next_pow2(num_kv_heads), HEAD_DIM_PAD=head_dim_pad,
                **pdl_args(q.device))
        else:
            cos, sin = rope
            half_pad, block_h = rope_block_heads(num_heads, head_dim)
            _rope_write_kv_kernel[(num_tokens, 1 + triton.cdiv(num_heads, block_h))](
                q, k, v, cos, sin, k_cache, v_cache, extra["slot_mapping"], q.stride(0), q.stride(1),
                k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), *cache_strides,
                num_heads, num_kv_heads,
                HALF=head_dim // 2, HALF_PAD=half_pad, BLOCK_H=block_h, KV_HEADS_PAD=_next_pow2(num_kv_heads),
                BLOCK_SIZE=block_size, num_warps=4, enable_fp_fusion=False, **pdl_args(q.device))

        block_tables = extra["block_tables"]
        if extra["num_short"]:
            num_short = extra["num_short"]
            block_m = max(16, _next_pow2(group * extra["max_short_query_len"]))
            num_splits = self.decode_splits(meta, num_kv_heads, q.device)
            split = num_splits > 1
            if split:
                split_out = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32,
                                        device=q.device)
                split_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
            else:
                split_out = split_lse = out  # not read or written without SPLIT
            _decode_kernel[(num_short, num_kv_heads, num_splits)](
                q, out, k_cache, v_cache, block_tables, extra["seq_lens"], extra["query_start_loc"],
                extra["short_seq_ids"], split_out, split_lse,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides, block_tables.stride(0),
                num_heads, num_splits, head_dim, qk_scale,
                GROUP=group, BLOCK_M=block_m, BLOCK_N=self.decode_tile_keys(head_dim_pad, num_splits),
                BLOCK_SIZE=block_size, HEAD_DIM_PAD=head_dim_pad, SPLIT=split, DOT_PRECISION=precision,
                num_warps=self.decode_warps or _num_warps(block_m, head_dim_pad), num_stages=self.decode_stages,
                **pdl_args(q.device))
            if split:
                _combine_splits_kernel[(num_short, num_heads, extra["max_short_query_len"])](
                    out, split_out, split_lse, extra["query_start_loc"], extra["short_seq_ids"],
                    out.stride(0), out.stride(1), num_heads, num_splits, head_dim,
                    SPLITS_PAD=_next_pow2(num_splits), HEAD_DIM_PAD=head_dim_pad,
                    num_warps=1 if _next_pow2(num_splits) * head_dim_pad <= 2048 else 4,
                    **pdl_args(q.device))

        tile_tokens = prefill_tile_tokens(group)
        num_tiles, tile_seqs, tile_firsts = extra["prefill_tiles"][tile_tokens]
        if num_tiles:
            block_m = max(16, _next_pow2(tile_tokens * group))
            _prefill_kernel[(num_tiles, num_kv_heads)](
                q, out, k_cache, v_cache, block_tables, extra["seq_lens"], extra["query_start_loc"],
                tile_seqs, tile_firsts,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides, block_tables.stride(0),
                head_dim, qk_scale,
                GROUP=group, TILE_TOKENS=tile_tokens, BLOCK_M=block_m, BLOCK_N=self.block_n,
                BLOCK_SIZE=block_size, HEAD_DIM_PAD=head_dim_pad, DOT_PRECISION=precision,
                num_warps=_num_warps(block_m, head_dim_pad), num_stages=2, **pdl_args(q.device))
        return out

