"""L2 warm-up of projection weights (``layers/triton_prefetch.py``).

- ``read_plan`` describes what the kernels launch: its split-K ranges are the ``SPLIT_K`` / ``k_per_split`` that
  the W8A16, W4A16 and 16-bit GEMV launches receive (launches recorded, not run), for Llama-8B and ragged shapes,
  row counts 1-32 and GPUs of 4 to 132 SMs; and no warm-up of any budget reaches past its range or the tensor.
- A decoder layer asks for its four windows in order (qkv after the input norm, o after the KV write, gate|up
  after the post-attention norm, down after SiLU-and-mul) with its own projections and row count, and the
  forward's output is unchanged; every attention backend calls ``after_kv_write`` once, after the cache write.
- Nothing is launched on CPU; the kernel compiles for sm_90 with the prefetches between the PDL launch of the next
  kernel and the wait for the one before (subprocess: a GPU target, not the interpreter).
The timing and the bit-equality of logits on the GPU: ``benchmarks/weight_prefetch_ab_gpu.py``.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
from specserve.layers import quant_tiles, triton_gemv, triton_prefetch, triton_splitk, triton_w4a16, triton_w8a16  # noqa: E402,I001
from specserve.layers.attention import TorchAttentionBackend, build_attention_metadata  # noqa: E402
from specserve.layers.linear import Linear  # noqa: E402
from specserve.layers.ops import TorchOps  # noqa: E402
from specserve.layers.quant_gpu import Fp8Linear, Int4Linear, quantize_fp8_rows  # noqa: E402
from specserve.layers.triton_prefetch import ReadPlan, read_plan  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (N, K): Llama-3.1-8B's qkv, o, gate|up, down and two ragged shapes
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1000, 768), (96, 4352)]


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch's arguments by name."""

    def __init__(self, fn) -> None:
        self.names = list(inspect.signature(fn.fn).parameters)
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(dict(zip(self.names, args)) | kwargs)


def recorded(monkeypatch, module, name: str, run) -> dict:
    rec = Recorder(getattr(module, name))
    monkeypatch.setattr(module, name, rec)
    run()
    assert len(rec.launches) == 1
    return rec.launches[0]


def check_plan(plan: ReadPlan, launch: dict, elem_bytes: int, row_bytes_per_k: int) -> None:
    """The plan's ranges are the launch's split-K ranges; every warm-up stays inside its range and the tensor."""
    split, k_per_split, k = launch["SPLIT_K"], launch["k_per_split"], launch["K"]
    assert plan.splits == split
    assert plan.split_stride == k_per_split * row_bytes_per_k * elem_bytes
    shortest = min(k_per_split, k - (split - 1) * k_per_split)
    assert plan.split_bytes == shortest * row_bytes_per_k * elem_bytes
    nbytes = plan.tensor.numel() * plan.tensor.element_size()
    for budget in (1, 4096, 1 << 20, 8 << 20, 1 << 40):
        prefix = plan.prefix(budget)
        assert 0 < prefix <= plan.split_bytes and prefix % triton_prefetch.LINE == 0 or prefix == plan.split_bytes
        last = (plan.rows - 1) * plan.row_stride + (plan.splits - 1) * plan.split_stride + prefix
        assert last <= nbytes
    assert plan.prefix(0) == 0


@settings(max_examples=30, deadline=None)
@given(shape=st.sampled_from(SHAPES), m=st.sampled_from([1, 2, 3, 4, 8, 16, 32]), sms=st.sampled_from([4, 78, 132]))
def test_fp8_plan_is_the_w8a16_launch(shape, m, sms):
    n, k = shape
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_splitk, "num_sms", lambda device: sms)
        w, w_scale = quantize_fp8_rows(torch.randn(n, k) * 0.02)
        proj = Fp8Linear(w, w_scale, use_triton=True)
        x_q, x_scale = quantize_fp8_rows(torch.randn(m, k))
        launch = recorded(mp, triton_w8a16, "_w8a16_kernel", lambda: triton_w8a16.w8a16_linear(
            x_q, w, w_scale, act_quant="per_token_prequant", x_scale=x_scale, out_dtype=torch.bfloat16))
        plan = read_plan(proj, m)
    assert (plan.rows, plan.row_stride) == (n, k)
    check_plan(plan, launch, 1, 1)


@settings(max_examples=20, deadline=None)
@given(shape=st.sampled_from(SHAPES), m=st.sampled_from([1, 2, 4, 16, 32]), sms=st.sampled_from([4, 78, 132]))
def test_int4_plan_is_the_w4a16_launch(shape, m, sms):
    n, k = shape
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_splitk, "num_sms", lambda device: sms)
        proj = Int4Linear.from_float(torch.randn(n, k) * 0.02, None, use_triton=True)
        x = torch.randn(m, k, dtype=torch.bfloat16)
        launch = recorded(mp, triton_w4a16, "_w4a16_kernel", lambda: proj(x))
        plan = read_plan(proj, m)
    assert plan.rows == 1  # [K // 8, N] words: a K range is one block of whole rows of N int32 words
    check_plan(plan, launch, proj.qweight.element_size(), n // 8)


@pytest.mark.parametrize("sms", [4, 132])
@pytest.mark.parametrize("shape", [(4096, 4096), (28672, 4096), (4096, 14336)])
def test_bf16_plan_is_the_gemv_launch(monkeypatch, shape, sms):
    n, k = shape
    monkeypatch.setattr(triton_splitk, "num_sms", lambda device: sms)
    proj = Linear(k, n, bias=False).to(torch.bfloat16)
    x = torch.randn(1, k, dtype=torch.bfloat16)
    launch = recorded(monkeypatch, triton_gemv, "_gemv_kernel", lambda: triton_gemv.gemv_linear(x, proj.weight))
    plan = read_plan(proj, 1)
    assert (plan.rows, plan.row_stride) == (n, 2 * k)
    check_plan(plan, launch, 2, 1)
    # more rows than the GEMV takes go to cuBLAS: every row from K = 0, whole
    assert read_plan(proj, 2) == ReadPlan(proj.weight, n, 2 * k, 1, 0, 2 * k)


def test_prefix_rounds_to_lines_within_the_budget():
    w = torch.empty(4096, 4096, dtype=torch.uint8)
    plan = ReadPlan(w, rows=4096, row_stride=4096, splits=5, split_stride=896, split_bytes=512)
    assert plan.prefix(8 << 20) == 384  # the module docstring's example: 409 bytes a range, 3 lines
    assert plan.prefix(100) == 128  # at least one line
    assert plan.prefix(1 << 40) == 512  # at most the shortest range


def test_nothing_is_launched_on_cpu(monkeypatch):
    monkeypatch.setattr(quant_tiles, "WEIGHT_PREFETCH", {"o": 1 << 30})
    proj = Linear(64, 64, bias=False)
    assert triton_prefetch.prefetch_weights(proj, 1, "o") == 0
    assert triton_prefetch.launch_prefetch(ReadPlan(proj.weight, 64, 256, 1, 0, 256), 1 << 20) == 0


class SpyOps:
    """The model's own ops (same numerics), recording the warm-ups asked for."""

    def __init__(self, inner: TorchOps) -> None:
        self.inner = inner
        self.calls: list = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefetch_weights(self, proj, num_rows, window):
        self.calls.append((proj, num_rows, window))
        return 0


def test_layers_warm_each_projection_in_its_window():
    from tests.tiny import tiny_engine
    engine = tiny_engine()
    model, runner = engine.runner.model, engine.runner
    ids = [3, 5, 7, 11, 13]
    args = (ids, list(range(len(ids))), [len(ids)], [len(ids)], [list(range(2))])
    expected = runner.forward(*args)[0].clone()
    spy = SpyOps(model.layers[0].ops)
    model.set_ops(spy)
    got = runner.forward(*args)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    want = []
    for layer in model.layers:
        want += [(layer.self_attn.qkv_proj, "qkv"), (layer.self_attn.o_proj, "o"), (layer.mlp.gate_up_proj, "gate_up"),
                 (layer.mlp.down_proj, "down")]
    assert [(p, w) for p, _, w in spy.calls] == want
    assert all(n == len(ids) for _, n, _ in spy.calls)


def backends():
    out = [TorchAttentionBackend()]
    from specserve.layers.cpu_attention import make_cpu_backend
    out.append(make_cpu_backend(torch.float32))  # the C++ paged backend where it builds
    return out


@pytest.mark.parametrize("backend", backends(), ids=lambda b: type(b).__name__)
def test_after_kv_write_sees_the_written_cache(backend):
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d, block = 4, 2, 16, 4
    meta = build_attention_metadata([2, 1], [5, 3], [[0, 1], [2]], block, torch.device("cpu"))
    backend.prepare(meta, block)
    q = torch.randn(3, heads, d, generator=gen)
    k = torch.randn(3, kv_heads, d, generator=gen)
    v = torch.randn(3, kv_heads, d, generator=gen)
    k_cache, v_cache = torch.zeros(3, block, kv_heads, d), torch.zeros(3, block, kv_heads, d)
    seen = []
    out = backend.forward(q, k, v, k_cache, v_cache, meta,
                          after_kv_write=lambda: seen.append((k_cache.clone(), v_cache.clone())))
    assert len(seen) == 1
    slots = meta.slot_mapping
    assert torch.equal(seen[0][0].view(-1, kv_heads, d)[slots], k)
    assert torch.equal(seen[0][1].view(-1, kv_heads, d)[slots], v)
    torch.testing.assert_close(out, backend.forward(q, k, v, k_cache, v_cache, meta), rtol=0, atol=0)


@pytest.mark.slow
def test_kernel_compiles_for_hopper(tmp_path):
    code = (
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "import triton\n"
        "from specserve.layers import triton_prefetch as tp\n"
        "sig = {'base': 'i64', 'num_items': 'i32', 'splits': 'i32', 'chunks': 'i32', 'row_stride': 'i32',\n"
        "       'split_stride': 'i32', 'prefix': 'i32', 'ITEMS': 'constexpr', 'CHUNK': 'constexpr',\n"
        "       'BULK': 'constexpr', 'USE_PDL': 'constexpr'}\n"
        "for bulk, op in ((True, 'cp.async.bulk.prefetch.L2.global'), (False, 'prefetch.global.L2::evict_last')):\n"
        "    items = tp.ITEMS_BULK if bulk else tp.ITEMS_LINE\n"
        "    const = {'ITEMS': items, 'CHUNK': tp.BULK_CHUNK if bulk else tp.LINE, 'BULK': bulk, 'USE_PDL': 1}\n"
        "    ptx = triton.compile(ASTSource(tp._l2_prefetch_kernel, sig, const), target=GPUTarget('cuda', 90, 32),\n"
        "                         options={'num_warps': 4, 'launch_pdl': True}).asm['ptx']\n"
        "    code = [line.strip() for line in ptx.splitlines() if not line.strip().startswith('//')]\n"
        "    at = [i for i, line in enumerate(code) if line.startswith(op)]\n"
        "    launch = [i for i, line in enumerate(code) if line.startswith('griddepcontrol.launch_dependents')]\n"
        "    wait = [i for i, line in enumerate(code) if line.startswith('griddepcontrol.wait')]\n"
        "    assert len(at) == items // 128, (op, len(at))  # 128 threads, items // 128 each\n"
        "    assert launch and wait and max(launch) < min(at) and max(at) < min(wait), (launch, at[:2], wait)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr
