"""The C++ paged-attention backend against the plain-torch reference backend (the oracle)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.layers.attention import TorchAttentionBackend
from specserve.layers.cpu_attention import CpuPagedAttentionBackend, load_attention_extension, make_cpu_backend
from tests import paged_batch
from tests.paged_batch import run_backends

ATOL = 1e-5


@pytest.fixture(scope="module")
def ext():
    module = load_attention_extension()
    assert module is not None, "the CPU paged-attention extension did not build (see the log)"
    return module


def make_batch(gen: torch.Generator, query_lens: list[int], context_lens: list[int], block_size: int,
               num_heads: int, num_kv_heads: int, head_dim: int):
    return paged_batch.make_batch(gen, query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim,
                                  torch.device("cpu"))


def run_both(ext, meta, q, k, v, k_cache, v_cache, block_size):
    """(out, k_cache, v_cache) from the oracle and from the C++ backend, each on its own copy of the caches."""
    return run_backends((TorchAttentionBackend(), CpuPagedAttentionBackend(ext)), meta, q, k, v, k_cache, v_cache,
                        block_size)


@st.composite
def batches(draw):
    num_seqs = draw(st.integers(1, 5))
    # mostly decode / verify lengths, with long prefill chunks (> MAX_PADDED_QUERY_LEN = 16) mixed in
    query_lens = draw(st.lists(st.one_of(st.integers(1, 5), st.integers(1, 20)), min_size=num_seqs,
                               max_size=num_seqs))
    context_lens = draw(st.lists(st.one_of(st.just(0), st.integers(0, 70)), min_size=num_seqs, max_size=num_seqs))
    block_size = draw(st.sampled_from([4, 16]))
    num_heads, num_kv_heads = draw(st.sampled_from([(4, 2), (9, 3), (8, 8)]))
    head_dim = draw(st.sampled_from([32, 64]))
    seed = draw(st.integers(0, 2**31 - 1))
    return query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_matches_torch_backend(ext, batch):
    query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim, seed = batch
    gen = torch.Generator().manual_seed(seed)
    meta, q, k, v, k_cache, v_cache = make_batch(gen, query_lens, context_lens, block_size, num_heads,
                                                 num_kv_heads, head_dim)
    (ref, ref_k, ref_v), (out, out_k, out_v) = run_both(ext, meta, q, k, v, k_cache, v_cache, block_size)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("num_seqs,seq_len", [(1, 1), (3, 33), (8, 300), (2, 1500)])
def test_decode_long_contexts(ext, num_seqs, seq_len):
    gen = torch.Generator().manual_seed(num_seqs * 1000 + seq_len)
    meta, q, k, v, k_cache, v_cache = make_batch(gen, [1] * num_seqs, [seq_len - 1] * num_seqs, 16, 9, 3, 64)
    (ref, ref_k, ref_v), (out, out_k, out_v) = run_both(ext, meta, q, k, v, k_cache, v_cache, 16)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("context_len", [0, 100])
def test_long_prefill_chunk(ext, context_len):
    gen = torch.Generator().manual_seed(context_len)
    meta, q, k, v, k_cache, v_cache = make_batch(gen, [200, 1, 37], [context_len, 50, 3], 16, 9, 3, 64)
    (ref, _, _), (out, _, _) = run_both(ext, meta, q, k, v, k_cache, v_cache, 16)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("head_dim", [12, 20])  # not a multiple of 8: the scalar path
def test_scalar_path_head_dims(ext, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    meta, q, k, v, k_cache, v_cache = make_batch(gen, [3, 1, 18], [5, 40, 0], 4, 4, 2, head_dim)
    (ref, ref_k, _), (out, out_k, _) = run_both(ext, meta, q, k, v, k_cache, v_cache, 4)
    assert torch.equal(out_k, ref_k)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_slot_minus_one_is_skipped(ext):
    gen = torch.Generator().manual_seed(7)
    meta, q, k, v, k_cache, v_cache = make_batch(gen, [1, 2, 1, 3], [9, 4, 20, 0], 4, 4, 2, 32)
    meta.slot_mapping[torch.tensor([1, 3, 6])] = -1  # padded tokens: their K/V must not be written
    (ref, ref_k, ref_v), (out, out_k, out_v) = run_both(ext, meta, q, k, v, k_cache, v_cache, 4)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)

    # write_kv on its own: written slots hold the rows, every other slot is untouched
    kc, vc = k_cache.clone(), v_cache.clone()
    ext.write_kv(k, v, kc, vc, meta.slot_mapping)
    flat_k, flat_v = kc.view(-1, 2, 32), vc.view(-1, 2, 32)
    expect_k, expect_v = k_cache.clone().view(-1, 2, 32), v_cache.clone().view(-1, 2, 32)
    for t, slot in enumerate(meta.slot_mapping.tolist()):
        if slot >= 0:
            expect_k[slot], expect_v[slot] = k[t], v[t]
    assert torch.equal(flat_k, expect_k) and torch.equal(flat_v, expect_v)


def test_int32_tables_and_strided_q(ext):
    gen = torch.Generator().manual_seed(3)
    meta, q, k, v, k_cache, v_cache = make_batch(gen, [2, 1, 17], [6, 30, 2], 16, 8, 8, 64)
    ref = TorchAttentionBackend()
    ref.prepare(meta, 16)
    expected = ref.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    # q as a view into a fused qkv projection: non-contiguous along tokens
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_view = qkv[:, :8 * 64].view(-1, 8, 64)
    k_view, v_view = qkv[:, 8 * 64:16 * 64].view(-1, 8, 64), qkv[:, 16 * 64:].view(-1, 8, 64)
    kc, vc = k_cache.clone(), v_cache.clone()
    ext.write_kv(k_view, v_view, kc, vc, meta.slot_mapping.to(torch.int32))
    seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
    out = ext.paged_attention(q_view, kc, vc, meta.block_tables.to(torch.int32), seq_lens,
                              meta.query_start_loc.to(torch.int32), 64 ** -0.5)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_rejects_non_fp32(ext):
    gen = torch.Generator().manual_seed(0)
    meta, q, k, v, k_cache, v_cache = make_batch(gen, [1], [3], 4, 4, 2, 32)
    backend = CpuPagedAttentionBackend(ext)
    backend.prepare(meta, 4)
    with pytest.raises(TypeError, match="float32"):
        backend.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta)


def test_make_cpu_backend(ext):
    assert isinstance(make_cpu_backend(torch.float32), CpuPagedAttentionBackend)
    assert isinstance(make_cpu_backend(torch.bfloat16), TorchAttentionBackend)
