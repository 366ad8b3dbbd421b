"""The Triton paged-attention backend against the plain-torch reference backend (the oracle).

Without a GPU the kernels run under Triton's interpreter (numpy, one program at a time). ``triton.jit`` decides
between compiling and interpreting when a kernel is *defined*, from ``TRITON_INTERPRET``, so the variable is
set before ``specserve.layers.triton_attention`` is imported (and the module is reloaded if something imported
it earlier without it). Batches are kept small: an interpreted launch costs 0.1-2 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.layers.attention import AttentionMetadata, TorchAttentionBackend, build_attention_metadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
from specserve.layers import triton_attention  # noqa: E402
from tests import paged_batch  # noqa: E402
from tests.paged_batch import run_backends  # noqa: E402
from tests.triton_interpreter import fix_interpreter, reload_interpreted  # noqa: E402

if DEVICE.type == "cpu":
    triton_attention = reload_interpreted(triton_attention, "_decode_kernel")
TritonAttentionBackend = triton_attention.TritonAttentionBackend

ATOL = 1e-5


if DEVICE.type == "cpu":
    fix_interpreter()  # tests/triton_interpreter.py: two Triton 3.6 interpreter bugs


def make_batch(gen: torch.Generator, query_lens: list[int], context_lens: list[int], block_size: int,
               num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32):
    """A random ragged batch on ``DEVICE`` whose q/k/v are views into one fused qkv matrix, as the model passes
    them (token stride != heads * head_dim)."""
    return paged_batch.make_batch(gen, query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim,
                                  DEVICE, dtype, fused_qkv=True)


def run_both(meta: AttentionMetadata, q, k, v, k_cache, v_cache, block_size: int, **triton_kwargs):
    """(out, k_cache, v_cache) from the oracle and from the Triton backend, each on its own copy of the caches."""
    return run_backends((TorchAttentionBackend(), TritonAttentionBackend(**triton_kwargs)), meta, q, k, v, k_cache,
                        v_cache, block_size)


def check(query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim, seed=0, atol=ATOL,
          dtype=torch.float32, **triton_kwargs):
    gen = torch.Generator().manual_seed(seed)
    meta, q, k, v, k_cache, v_cache = make_batch(gen, query_lens, context_lens, block_size, num_heads,
                                                 num_kv_heads, head_dim, dtype)
    (ref, ref_k, ref_v), (out, out_k, out_v) = run_both(meta, q, k, v, k_cache, v_cache, block_size,
                                                        **triton_kwargs)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


HEADS = [(9, 3, 64), (4, 4, 128)]  # SmolLM2 GQA group of 3; plain multi-head at head_dim 128


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
def test_decode_across_block_boundaries(num_heads, num_kv_heads, head_dim):
    # seq_len = context + 1 lands on, just before and just after block (16) and key-tile (64) boundaries
    context_lens = [0, 14, 15, 16, 31, 63, 64, 100]
    check([1] * len(context_lens), context_lens, 16, num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
def test_verify_mixed_with_decode_rows(num_heads, num_kv_heads, head_dim):
    # verify rows (1 + num_spec_tokens = 2..8), plain decode rows and num_spec_tokens = 0 rows (query_len 1)
    query_lens = [2, 1, 8, 5, 1, 3]
    context_lens = [9, 30, 16, 0, 47, 70]
    check(query_lens, context_lens, 16, num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_split_kv_matches(num_splits):
    # block_n 16 -> up to 10 key tiles per sequence; the short sequences leave some splits empty
    query_lens = [1, 4, 1, 16]
    context_lens = [150, 20, 2, 60]
    check(query_lens, context_lens, 16, 8, 2, 64, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
def test_chunked_prefill_with_context(num_heads, num_kv_heads, head_dim):
    # a first chunk (no context), later chunks after 50 / 100 cached tokens, lengths not multiples of a tile
    check([40, 17, 33], [0, 50, 100], 16, num_heads, num_kv_heads, head_dim)


def test_mixed_prefill_decode_verify_small_blocks():
    # one step of continuous batching: prefill chunk + decode + verify, block_size 4, head_dim 48 (padded to 64)
    check([1, 25, 4, 1], [12, 7, 0, 3], 4, 6, 2, 48, block_n=32)


def test_padded_slots_are_not_written():
    gen = torch.Generator().manual_seed(3)
    block_size = 16
    meta, q, k, v, k_cache, v_cache = make_batch(gen, [3, 1, 20], [5, 16, 8], block_size, 9, 3, 64)
    real_slots = meta.slot_mapping.clone()
    padded = torch.tensor([1, 3, 10, 23], device=DEVICE)  # tokens of every sequence, incl. the prefill chunk
    meta.slot_mapping[padded] = -1
    (ref, ref_k, ref_v), (out, out_k, out_v) = run_both(meta, q, k, v, k_cache, v_cache, block_size)
    flat = (-1, 3, 64)
    # the padded tokens' slots keep their old contents; every other token's K/V is in place
    written = meta.slot_mapping >= 0
    for cache, old, new in ((out_k, k_cache, k), (out_v, v_cache, v)):
        assert torch.equal(cache.view(flat)[real_slots[padded]], old.view(flat)[real_slots[padded]])
        assert torch.equal(cache.view(flat)[meta.slot_mapping[written]], new[written])
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_bfloat16_close_to_reference():
    check([1, 3, 20], [30, 9, 5], 16, 8, 2, 64, atol=3e-2, dtype=torch.bfloat16)


def test_forward_needs_prepare():
    gen = torch.Generator().manual_seed(0)
    meta, q, k, v, k_cache, v_cache = make_batch(gen, [1], [3], 16, 4, 2, 32)
    with pytest.raises(AssertionError, match="prepare"):
        TritonAttentionBackend().forward(q, k, v, k_cache, v_cache, meta)
    TorchAttentionBackend().prepare(meta, 16)  # another backend's metadata is not ours
    with pytest.raises(AssertionError, match="prepare"):
        TritonAttentionBackend().forward(q, k, v, k_cache, v_cache, meta)


def test_prepare_builds_tiles_and_short_ids():
    meta = build_attention_metadata([1, 40, 3], [9, 140, 20], [[0], [1] * 9, [2, 3]], 16, DEVICE)
    TritonAttentionBackend().prepare(meta, 16)
    extra = meta.extra
    assert extra["short_seq_ids"].tolist() == [0, 2]
    assert extra["seq_lens"].tolist() == [9, 140, 20]
    assert (extra["num_short"], extra["max_short_query_len"], extra["max_short_seq_len"]) == (2, 3, 20)
    n, seqs, firsts = extra["prefill_tiles"][16]
    assert n == 3 and seqs.tolist() == [1, 1, 1] and firsts.tolist() == [0, 16, 32]
    n, seqs, firsts = extra["prefill_tiles"][64]
    assert n == 1 and firsts.tolist() == [0]


def test_prefill_tile_tokens():
    assert [triton_attention.prefill_tile_tokens(g) for g in (1, 2, 3, 4, 8, 16)] == [64, 32, 16, 16, 16, 16]


def test_default_backend_on_cuda_honours_the_disable_switch(monkeypatch):
    from specserve.engine.model_runner import DISABLE_TRITON_ATTENTION_ENV, default_backend
    cuda = torch.device("cuda")  # constructing a backend touches no device
    monkeypatch.delenv(DISABLE_TRITON_ATTENTION_ENV, raising=False)
    assert isinstance(default_backend(cuda, torch.bfloat16), TritonAttentionBackend)
    monkeypatch.setenv(DISABLE_TRITON_ATTENTION_ENV, "1")
    assert isinstance(default_backend(cuda, torch.bfloat16), TorchAttentionBackend)


def test_cpu_paths_do_not_import_triton():
    # The engine, CLI and drafters, and picking a CPU backend, must not load Triton (bf16: no C++ build).
    code = (
        "import sys\n"
        "import torch\n"
        "from specserve.engine.model_runner import default_backend\n"
        "default_backend(torch.device('cpu'), torch.bfloat16)\n"
        "import specserve.cli, specserve.engine.engine, specserve.spec.factory\n"
        "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True, timeout=120)


@st.composite
def batches(draw):
    num_seqs = draw(st.integers(1, 4))
    # mostly decode / verify lengths, with prefill chunks (> MAX_PADDED_QUERY_LEN = 16) mixed in
    query_lens = draw(st.lists(st.one_of(st.integers(1, 9), st.integers(1, 24)), min_size=num_seqs,
                               max_size=num_seqs))
    context_lens = draw(st.lists(st.one_of(st.just(0), st.integers(0, 80)), min_size=num_seqs, max_size=num_seqs))
    block_size = draw(st.sampled_from([4, 16]))
    num_heads, num_kv_heads = draw(st.sampled_from([(4, 2), (9, 3), (4, 4)]))
    head_dim = draw(st.sampled_from([32, 64]))
    num_splits = draw(st.sampled_from([None, 2, 3]))
    seed = draw(st.integers(0, 2**31 - 1))
    return query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim, num_splits, seed


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_random_ragged_batches_match_torch_backend(batch):
    query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim, num_splits, seed = batch
    check(query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim, seed=seed,
          num_splits=num_splits, block_n=16)


@pytest.mark.slow
def test_kernels_compile_for_hopper(tmp_path):
    # The interpreter never lowers the kernels; compile the backend's real launches for sm_90 (no GPU needed).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, os.path.join(root, "tests", "unit", "triton_compile_check.py"),
                             "--quick"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    # write_kv, rope + write_kv, prefill, combine (3 variants collapsed into 1), decode at 3 tile heights x split
    assert "10 kernel variants compiled for sm_90" in result.stdout


def test_engine_greedy_output_equals_reference_backend():
    # The whole engine (chunked prefill at budget 16, n-gram drafts verified 1 + 3 tokens at a time) on the Triton
    # backend gives the reference backend's greedy tokens. head_dim 8 here: padded to 16 inside the kernels.
    from specserve.config import SpecConfig
    from specserve.sampling import SamplingParams
    from tests.tiny import prompts, tiny_engine

    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ps = prompts([5, 17, 3, 40])
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend(num_splits=2)):
        engine = tiny_engine(max_num_batched_tokens=16, spec=SpecConfig(method="ngram", num_spec_tokens=3,
                                                                        ngram_min=1, ngram_max=2))
        engine.runner.backend = backend
        results = engine.generate(ps, greedy)
        outs.append([r.output_ids for r in results])
        assert sum(r.spec_counters.num_drafts for r in results) > 0  # verify steps happened
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert outs[1] == outs[0]


def test_engine_static_padded_path_on_triton_backend():
    # The padded static-buffer step a CUDA graph replays (engine/cuda_graphs.py, run here without capture):
    # prepare_static's fixed-shape indices and pinned num_splits give the reference backend's greedy tokens,
    # 3 sequences padded into bucket 4, decode and n-gram verify rows.
    from specserve.config import CudaGraphConfig, SpecConfig
    from specserve.engine.cuda_graphs import CudaGraphRunner
    from specserve.sampling import SamplingParams
    from tests.tiny import prompts, tiny_engine

    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ps = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5], prompts([4])[0]]  # repeats: the n-gram lookup drafts
    outs = []
    for static in (False, True):
        engine = tiny_engine(max_num_batched_tokens=32, max_model_len=64,
                             spec=SpecConfig(method="ngram", num_spec_tokens=2, ngram_min=1, ngram_max=2))
        runner = engine.runner
        if static:
            runner.backend = TritonAttentionBackend(num_splits=2)
            runner.graphs = CudaGraphRunner(runner.model, runner.kv_caches, runner.backend,
                                            CudaGraphConfig(batch_sizes=(1, 2, 4), max_query_len=4),
                                            runner.block_size, engine.max_model_len, 4, runner.device, capture=False)
        else:
            runner.backend = TorchAttentionBackend()
        results = engine.generate(ps, greedy)
        outs.append([r.output_ids for r in results])
        if static:
            assert runner.graphs.replays_by_query_len.get(1, 0) > 0
            assert any(q > 1 for q in runner.graphs.replays_by_query_len)
    assert outs[1] == outs[0]


def test_decode_tile_keys_by_head_size_and_override():
    """Heads of 128 decode in tiles of 128 keys (timed faster on the H200), narrower heads too when the step is
    unsplit, else ``block_n``; ``decode_block_n`` overrides all, and the results match the reference across the
    128-key tile edges."""
    from specserve.layers.triton_attention import DECODE_BLOCK_N_WIDE_HEADS, TritonAttentionBackend
    backend = TritonAttentionBackend()
    assert DECODE_BLOCK_N_WIDE_HEADS == 128
    assert [backend.decode_tile_keys(128, s) for s in (1, 4)] == [128, 128]
    assert [backend.decode_tile_keys(64, s) for s in (1, 4)] == [128, 64]
    assert [TritonAttentionBackend(decode_block_n=32).decode_tile_keys(d, 1) for d in (64, 128)] == [32, 32]
    for bad in (dict(decode_block_n=48), dict(decode_warps=3), dict(decode_stages=0)):
        with pytest.raises(ValueError):
            TritonAttentionBackend(**bad)
    context_lens = [126, 127, 128, 129, 200]
    check([1, 3, 1, 2, 1], context_lens, 16, 4, 2, 128)
    check([1, 3, 1, 2, 1], context_lens, 16, 9, 3, 64)  # unsplit on the interpreter: 128-key tiles for 64-wide heads
    check([1, 3, 1, 2, 1], context_lens, 16, 4, 2, 128, decode_block_n=32, num_splits=3)


def test_auto_splits_fill_the_sms_only_when_programs_are_fewer():
    """``auto_splits``: no split once the (sequence, kv head) programs cover the SMs; below that about
    ``DECODE_SPLIT_WAVES`` programs per SM, capped at ``MAX_AUTO_SPLITS`` (132 SMs, Llama's 8 kv heads and
    SmolLM2's 3)."""
    from specserve.layers.triton_attention import DECODE_SPLIT_WAVES, MAX_AUTO_SPLITS, auto_splits
    assert DECODE_SPLIT_WAVES == 4 and MAX_AUTO_SPLITS == 16
    assert [auto_splits(b * 8, 132) for b in (1, 4, 8, 16, 17, 32)] == [16, 16, 8, 4, 1, 1]
    assert [auto_splits(b * 3, 132) for b in (1, 8, 32, 44, 64)] == [16, 16, 5, 1, 1]
    for programs in range(1, 300):
        splits = auto_splits(programs, 132)
        assert 1 <= splits <= MAX_AUTO_SPLITS
        assert splits == 1 or programs * splits <= DECODE_SPLIT_WAVES * 132


def check_fused_rope(query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0,
                     padded=(), table_dtype=None):
    """``forward(..., rope=(cos, sin))`` (q and k rotated in the cache-write launch) against the layer's old order:
    ``TorchOps.rope_`` on q and k, then the torch reference backend. Rotated q / k and both caches must equal the
    reference bit for bit (same roundings), the attention output to ATOL (fp32) or bf16 tolerance. ``padded``:
    tokens whose slot is -1 (rotated, not written); ``table_dtype``: cos/sin in another dtype than q (the backend
    then rotates with torch, as the rope op would)."""
    from specserve.layers.ops import TorchOps
    from specserve.layers.rope import RotaryEmbedding
    gen = torch.Generator().manual_seed(seed)
    meta, q, k, v, k_cache, v_cache = make_batch(gen, query_lens, context_lens, block_size, num_heads,
                                                 num_kv_heads, head_dim, dtype)
    meta.slot_mapping[list(padded)] = -1
    positions = torch.tensor([c + i for c, n in zip(context_lens, query_lens) for i in range(n)], device=DEVICE)
    cos, sin = RotaryEmbedding(head_dim, 4096, 500000.0, None, DEVICE).cos_sin(positions, table_dtype or dtype)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # a second fused qkv, same values
    hq, hk = num_heads * head_dim, num_kv_heads * head_dim
    views = [fused[:, :hq].view_as(q), fused[:, hq:hq + hk].view_as(k), fused[:, hq + hk:].view_as(v)]
    q_ref, k_ref = TorchOps.rope_(q.clone(), cos, sin), TorchOps.rope_(k.clone(), cos, sin)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    oracle = TorchAttentionBackend()
    oracle.prepare(meta, block_size)
    ref = oracle.forward(q_ref, k_ref, v, ref_k_cache, ref_v_cache, meta)
    backend = TritonAttentionBackend()
    assert backend.fuses_rope
    backend.prepare(meta, block_size)
    with mock.patch.object(triton_attention.TorchOps, "rope_", wraps=TorchOps.rope_) as torch_rope:
        out = backend.forward(*views, k_cache, v_cache, meta, rope=(cos, sin))
    assert torch_rope.call_count == (0 if table_dtype is None else 2)  # the kernel rotated, or torch's op did
    assert torch.equal(views[0], q_ref) and torch.equal(views[1], k_ref) and torch.equal(views[2], v)
    assert torch.equal(k_cache, ref_k_cache) and torch.equal(v_cache, ref_v_cache)
    atol = ATOL if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [*HEADS, (6, 2, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_write_kv_matches_rope_then_write(num_heads, num_kv_heads, head_dim, dtype):
    # decode, verify and a prefill chunk in one step; two padded tokens (a decode row and one of the chunk)
    check_fused_rope([1, 4, 19, 1], [30, 9, 5, 0], 16, num_heads, num_kv_heads, head_dim, dtype, padded=(0, 10))


def test_fused_rope_llama_heads_split_query_head_blocks():
    # 32 query heads of 128: two 16-head programs per token besides the k/v one
    check_fused_rope([1, 2], [17, 40], 16, 32, 8, 128, torch.bfloat16)


def test_fused_rope_other_table_dtype_rotates_as_torch():
    # fp32 tables with bf16 q/k: torch promotes the products to fp32 before rounding, so the backend runs torch's op
    check_fused_rope([1, 3], [12, 4], 16, 9, 3, 64, torch.bfloat16, table_dtype=torch.float32)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])  # rope on views of qkv; on q/k norms' outputs (qwen3)
def test_model_with_fused_rope_matches_torch_backend(architecture):
    """A whole tiny model (prefill of 5 tokens, then one decode token) through the Triton backend, which rotates q
    and k in its cache-write launch, against the torch reference backend after the layer's own rope op: the same
    hidden states and caches (fp32, to the attention tolerance)."""
    from specserve.models.loader import _init_dummy, build_model
    from tests.tiny import tiny_config
    config = tiny_config(architecture, num_hidden_layers=1)  # one layer: interpreted launches are slow
    model = build_model(config, config.max_position_embeddings, torch.float32, DEVICE)
    _init_dummy(model, 0)
    hd, kvh = config.head_dim, config.num_key_value_heads
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        caches = [(torch.zeros(3, 4, kvh, hd, device=DEVICE), torch.zeros(3, 4, kvh, hd, device=DEVICE))
                  for _ in range(config.num_hidden_layers)]
        hidden = []
        for ids, start in (([5, 17, 3, 88, 41], 0), ([23], 5)):
            n = len(ids)
            meta = build_attention_metadata([n], [start + n], [[2, 0, 1]], 4, DEVICE)
            backend.prepare(meta, 4)
            with torch.inference_mode():
                h, _ = model(torch.tensor(ids, device=DEVICE), torch.arange(start, start + n, device=DEVICE),
                             caches, meta, backend)
            hidden.append(h)
        results.append((torch.cat(hidden), caches))
    (ref, ref_caches), (got, got_caches) = results
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    for (rk, rv), (gk, gv) in zip(ref_caches, got_caches):
        torch.testing.assert_close(gk, rk, atol=1e-5, rtol=0)
        torch.testing.assert_close(gv, rv, atol=1e-5, rtol=0)

