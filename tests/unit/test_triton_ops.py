"""The Triton elementwise ops (``layers/triton_ops.py``) against ``TorchOps``, the torch reference.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET`` set before the module is imported,
``tests/triton_interpreter.py`` patching the interpreter's bugs, among them its bf16 rounding). Comparisons are
in ulps of the output dtype: the residual update and RoPE must be bitwise torch's; the norms may differ by the
last bit of ``rsqrt`` (the sum of squares is reduced in another order) and silu by ``exp``'s last bits.
Shapes are small (an interpreted launch runs its programs one by one in numpy), except one SmolLM2-sized row.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.layers.ops import DISABLE_TRITON_OPS_ENV, TorchOps, select_ops
from specserve.layers.rope import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
from specserve.layers import quant_tiles, triton_ops, triton_splitk, triton_w8a16  # noqa: E402
from specserve.layers.quant_gpu import Fp8Activations, Fp8Linear, quantize_fp8_rows  # noqa: E402
from tests.triton_interpreter import fix_interpreter, reload_interpreted_chain  # noqa: E402

if DEVICE.type == "cpu":
    # triton_ops binds the FP8 quantizer's @triton.jit helpers from triton_w8a16: reload them interpreted first
    _, triton_w8a16, triton_ops = reload_interpreted_chain(
        (triton_splitk, "splitk_reduce"), (triton_w8a16, "_fp8_scale"), (triton_ops, "_rms_norm_kernel"))
    fix_interpreter()
TritonOps = triton_ops.TritonOps

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [0, 1, 7, 33]
# Largest ulp distance from TorchOps for the norms and silu_and_mul. 16-bit: rsqrt's (exp's) last fp32 bit can
# flip the rounding of x * rstd (silu(gate)) by one ulp, which the following multiply can carry to two (bf16
# shows none here, fp16 with 3 more mantissa bits the odd one). fp32: F.rms_norm and torch's exp on CPU round
# differently from the kernels' plain fp32 arithmetic by up to ~5 ulps (8 ulps = 1e-6 relative).
ULPS = {torch.float32: 8, torch.bfloat16: 2, torch.float16: 2}
HYPOTHESIS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Float bits as integers ordered like the values (adjacent floats differ by 1; -0 == +0)."""
    int_dtype, magnitude = {4: (torch.int32, 0x7FFFFFFF), 2: (torch.int16, 0x7FFF)}[t.element_size()]
    bits = t.contiguous().view(int_dtype).long()
    return torch.where(bits < 0, -(bits & magnitude), bits)


def assert_ulps(actual: torch.Tensor, expected: torch.Tensor, max_ulps: int) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not actual.isnan().any()
    if actual.numel():
        ulps = (ordered_bits(actual) - ordered_bits(expected)).abs().max().item()
        assert ulps <= max_ulps, f"{ulps} ulps apart (at most {max_ulps} allowed)"


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def strided_rows(gen: torch.Generator, rows: int, cols: int, extra_cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A [rows, cols] view into a wider matrix (row stride cols + extra_cols), starting at column 1 if it can."""
    base = randn(gen, rows, cols + extra_cols, dtype=dtype, scale=3.0)
    start = min(1, extra_cols)
    return base[:, start:start + cols]


def check_rms_norm(rows: int, hidden: int, extra_cols: int, dtype: torch.dtype, seed: int = 0,
                   eps: float = 1e-5) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = strided_rows(gen, rows, hidden, extra_cols, dtype)
    weight = randn(gen, hidden, dtype=dtype)
    x_before = x.clone()
    assert_ulps(TritonOps().rms_norm(x, weight, eps), TorchOps.rms_norm(x, weight, eps), ULPS[dtype])
    assert torch.equal(x, x_before)


def check_fused_add_rms_norm(rows: int, hidden: int, extra_cols: int, dtype: torch.dtype, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = strided_rows(gen, rows, hidden, extra_cols, dtype)
    residual = randn(gen, rows, hidden, dtype=dtype, scale=5.0)
    weight = randn(gen, hidden, dtype=dtype)
    expected_residual = residual.clone()
    expected = TorchOps.fused_add_rms_norm(x, expected_residual, weight, 1e-6)
    out = TritonOps().fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_residual)  # the add in the activation dtype, bit for bit, in place
    assert_ulps(out, expected, ULPS[dtype])


def check_silu_and_mul(rows: int, intermediate: int, extra_cols: int, dtype: torch.dtype, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    gate_up = strided_rows(gen, rows, 2 * intermediate, extra_cols, dtype)
    assert_ulps(TritonOps().silu_and_mul(gate_up), TorchOps.silu_and_mul(gate_up), ULPS[dtype])


def check_rope(rows: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0,
               fused_qkv: bool = True, max_position: int = 4096) -> None:
    """RoPE on qk exactly as ``models/llama.py`` Attention.forward passes it: a [n, heads + kv_heads, head_dim]
    view into the fused qkv output (row stride q_size + 2 * kv_size), or a contiguous tensor (the QK-norm path)."""
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(gen, rows, q_size + 2 * kv_size, dtype=dtype, scale=2.0)
    positions = torch.randint(0, max_position, (rows,), generator=gen).to(DEVICE)
    rope = RotaryEmbedding(head_dim, max_position, 500000.0, None, DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    expected = qkv.clone()

    def qk_of(t: torch.Tensor) -> torch.Tensor:
        if fused_qkv:
            return t[:, :q_size + kv_size].view(rows, num_heads + num_kv_heads, head_dim)
        return t[:, :q_size + kv_size].contiguous().view(rows, num_heads + num_kv_heads, head_dim)

    qk, qk_ref = qk_of(qkv), qk_of(expected)
    assert TritonOps().rope_(qk, cos, sin) is qk
    TorchOps.rope_(qk_ref, cos, sin)
    assert torch.equal(qk, qk_ref)
    assert torch.equal(qkv[:, q_size + kv_size:], expected[:, q_size + kv_size:])  # v untouched
    if fused_qkv:
        assert torch.equal(qkv, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 896])
def test_rms_norm(rows, hidden, dtype):
    check_rms_norm(rows, hidden, 0, dtype)
    check_rms_norm(rows, hidden, 5, dtype, seed=1)  # strided rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_smollm2_hidden(dtype):
    check_rms_norm(7, 576, 0, dtype)
    check_fused_add_rms_norm(7, 576, 3 * 576, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 896])
def test_fused_add_rms_norm(rows, hidden, dtype):
    check_fused_add_rms_norm(rows, hidden, 0, dtype)
    check_fused_add_rms_norm(rows, hidden, 7, dtype, seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("intermediate", [64, 1536])
def test_silu_and_mul(rows, intermediate, dtype):
    check_silu_and_mul(rows, intermediate, 0, dtype)
    check_silu_and_mul(rows, intermediate, 3, dtype, seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 128)])
def test_rope_in_fused_qkv(rows, num_heads, num_kv_heads, head_dim, dtype):
    check_rope(rows, num_heads, num_kv_heads, head_dim, dtype)


def test_rope_llama8b_heads():
    # 40 heads of 128: three programs per token of 16 heads each (the last one partly masked)
    check_rope(3, 32, 8, 128, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_contiguous_qk(dtype):
    check_rope(5, 4, 2, 64, dtype, fused_qkv=False)


def test_float16():
    for check in (check_rms_norm, check_fused_add_rms_norm):
        check(5, 96, 3, torch.float16)
    check_silu_and_mul(5, 48, 0, torch.float16)
    check_rope(5, 4, 2, 64, torch.float16)


def test_leading_dims_and_odd_sizes():
    gen = torch.Generator().manual_seed(3)
    x = randn(gen, 2, 3, 33, dtype=torch.bfloat16)  # [batch, heads, head_dim]: flattened to rows
    weight = randn(gen, 33, dtype=torch.bfloat16)
    assert_ulps(TritonOps().rms_norm(x, weight, 1e-6), TorchOps.rms_norm(x, weight, 1e-6), ULPS[torch.bfloat16])
    check_rms_norm(3, 1, 0, torch.float32)
    check_silu_and_mul(3, 1, 2, torch.float32)


def test_unsupported_layouts_fall_back_to_torch():
    gen = torch.Generator().manual_seed(4)
    ops = TritonOps()
    x = randn(gen, 16, 8, dtype=torch.float32).t()  # columns not contiguous: rms_norm copies them first
    weight = randn(gen, 16, dtype=torch.float32)
    assert_ulps(ops.rms_norm(x, weight, 1e-6), TorchOps.rms_norm(x, weight, 1e-6), ULPS[torch.float32])
    xb = randn(gen, 4, 16, dtype=torch.bfloat16)  # fp32 weight with bf16 activations: torch promotes to fp32
    out = ops.rms_norm(xb, weight, 1e-6)
    assert out.dtype == torch.float32 and torch.equal(out, TorchOps.rms_norm(xb, weight, 1e-6))
    gu = randn(gen, 6, 4, dtype=torch.float32).t()
    assert torch.equal(ops.silu_and_mul(gu), TorchOps.silu_and_mul(gu))
    qk = randn(gen, 3, 4, 16, dtype=torch.bfloat16)
    cos, sin = randn(gen, 3, 1, 16, dtype=torch.float32), randn(gen, 3, 1, 16, dtype=torch.float32)
    ref = qk.clone()
    ops.rope_(qk, cos, sin)  # fp32 cos/sin with bf16 qk
    TorchOps.rope_(ref, cos, sin)
    assert torch.equal(qk, ref)
    residual = randn(gen, 8, 16, dtype=torch.float32)
    ref_residual = residual.clone()
    x = randn(gen, 16, 8, dtype=torch.float32).t()  # the in-place residual add keeps torch's own path
    torch.testing.assert_close(ops.fused_add_rms_norm(x, residual, weight, 1e-6),
                               TorchOps.fused_add_rms_norm(x, ref_residual, weight, 1e-6), rtol=0, atol=0)
    assert torch.equal(residual, ref_residual)


@HYPOTHESIS
@given(rows=st.integers(0, 9), hidden=st.sampled_from([1, 7, 32, 33, 100, 256, 300]),
       extra_cols=st.sampled_from([0, 5, 64]), dtype=st.sampled_from(DTYPES + [torch.float16]),
       eps=st.sampled_from([1e-5, 1e-6]), seed=st.integers(0, 2**16))
def test_norms_property(rows, hidden, extra_cols, dtype, eps, seed):
    check_rms_norm(rows, hidden, extra_cols, dtype, seed, eps)
    check_fused_add_rms_norm(rows, hidden, extra_cols, dtype, seed)


@HYPOTHESIS
@given(rows=st.integers(0, 9), intermediate=st.sampled_from([1, 5, 24, 130, 1100]),
       extra_cols=st.sampled_from([0, 3]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_silu_and_mul_property(rows, intermediate, extra_cols, dtype, seed):
    check_silu_and_mul(rows, intermediate, extra_cols, dtype, seed)


@HYPOTHESIS
@given(rows=st.integers(0, 9), heads=st.sampled_from([(1, 1), (4, 2), (9, 3), (6, 1), (20, 4)]),
       head_dim=st.sampled_from([2, 32, 64, 80, 128]), dtype=st.sampled_from(DTYPES), fused_qkv=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rope_property(rows, heads, head_dim, dtype, fused_qkv, seed):
    check_rope(rows, heads[0], heads[1], head_dim, dtype, seed, fused_qkv)


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("llama", torch.bfloat16),
                                        ("qwen3", torch.float32)])
def test_tiny_model_logits_match_torch_ops(arch, dtype, monkeypatch):
    from specserve.layers.attention import TorchAttentionBackend, build_attention_metadata
    from specserve.models.loader import _init_dummy, build_model
    from tests.tiny import shape_for_tests, tiny_config

    config = tiny_config(arch)
    model = build_model(config, config.max_position_embeddings, dtype, DEVICE)
    _init_dummy(model, 0)
    shape_for_tests(model)
    gen = torch.Generator().manual_seed(0)
    n, block_size = 11, 4
    ids = torch.randint(0, config.vocab_size, (n,), generator=gen).to(DEVICE)
    blocks = -(-n // block_size)

    def logits(ops: TorchOps) -> torch.Tensor:
        model.set_ops(ops)
        shape = (blocks, block_size, config.num_key_value_heads, config.head_dim)
        caches = [(torch.zeros(shape, dtype=dtype, device=DEVICE), torch.zeros(shape, dtype=dtype, device=DEVICE))
                  for _ in model.layers]
        meta = build_attention_metadata([n], [n], [list(range(blocks))], block_size, DEVICE)
        backend = TorchAttentionBackend()
        backend.prepare(meta, block_size)
        with torch.inference_mode():
            hidden, _ = model(ids, torch.arange(n, device=DEVICE), caches, meta, backend)
            return model.compute_logits(hidden)

    expected = logits(TorchOps())
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rope_"):  # every op must take its kernel
        monkeypatch.setattr(TorchOps, name, staticmethod(lambda *args, name=name: pytest.fail(f"{name} fell back")))
    actual = logits(TritonOps())
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:  # bf16: the ops agree bit for bit here (checked above), so the logits do too
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def test_select_ops_on_cuda_honours_the_disable_switch(monkeypatch):
    cuda = torch.device("cuda")  # choosing ops touches no device
    monkeypatch.delenv(DISABLE_TRITON_OPS_ENV, raising=False)
    assert isinstance(select_ops(cuda, torch.bfloat16), TritonOps)
    assert isinstance(select_ops(cuda, torch.float32), TritonOps)
    monkeypatch.setenv(DISABLE_TRITON_OPS_ENV, "1")
    assert type(select_ops(cuda, torch.bfloat16)) is TorchOps


def test_select_ops_on_cpu_is_not_triton():
    for dtype in (torch.float32, torch.bfloat16):
        assert not isinstance(select_ops(torch.device("cpu"), dtype), TritonOps)


def test_cpu_ops_selection_never_imports_triton():
    code = (
        "import sys, torch\n"
        "from specserve.layers.ops import select_ops\n"
        "for dtype in (torch.float32, torch.bfloat16, torch.float16):\n"
        "    select_ops(torch.device('cpu'), dtype)\n"
        "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True, timeout=120)


@pytest.mark.slow
def test_kernels_compile_for_hopper(tmp_path):
    # The interpreter never lowers the kernels: compile every launch of three model shapes for sm_90 (no GPU needed),
    # the fused FP8 quantizer variants included (--fp8).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, os.path.join(root, "tests", "unit", "triton_ops_compile_check.py"),
                             "--fp8"], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "47 kernel variants compiled for sm_90" in result.stdout


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_ops_replay_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(5)
    ops, dtype = TritonOps(), torch.bfloat16
    hidden, heads, kv_heads, head_dim, inter, n = 576, 9, 3, 64, 1536, 8
    x = randn(gen, n, hidden, dtype=dtype)
    residual = randn(gen, n, hidden, dtype=dtype)
    weight = randn(gen, hidden, dtype=dtype)
    qkv = randn(gen, n, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    gate_up = randn(gen, n, 2 * inter, dtype=dtype)
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None, DEVICE)
    cos, sin = rope.cos_sin(torch.arange(n, device=DEVICE), dtype)
    start = (residual.clone(), qkv.clone())

    def step():
        qk = qkv[:, :(heads + kv_heads) * head_dim].view(n, heads + kv_heads, head_dim)
        ops.rope_(qk, cos, sin)
        return ops.fused_add_rms_norm(x, residual, weight, 1e-5), ops.rms_norm(x, weight, 1e-5), \
            ops.silu_and_mul(gate_up)

    eager = step()  # compiles every kernel before the capture
    eager_state = (residual.clone(), qkv.clone())
    residual.copy_(start[0])
    qkv.copy_(start[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    residual.copy_(start[0])
    qkv.copy_(start[1])
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out + (residual, qkv), eager + eager_state):
        assert torch.equal(a, b)


# ---- fused FP8 activation quantizer (rms_norm_fp8, fused_add_rms_norm_fp8, silu_and_mul_fp8) --------------------
FP8_DTYPES = [torch.bfloat16, torch.float16]
FP8_ROWS = [1, 7, 33]


def assert_quantized_as(acts: Fp8Activations, out: torch.Tensor) -> None:
    """``acts`` is bit for bit the fused quantizer run on ``out`` (the unfused op's 16-bit output)."""
    x_q, scale = triton_w8a16.quantize_fp8_rows_triton(out)
    assert acts.dtype == out.dtype and acts.x_q.dtype == torch.float8_e4m3fn and acts.x_q.shape == out.shape
    assert acts.scale.dtype == torch.float32 and acts.scale.shape == (out.shape[0], 1)
    assert torch.equal(acts.scale, scale)
    assert torch.equal(acts.x_q.view(torch.uint8), x_q.view(torch.uint8))
    ref_q, ref_scale = quantize_fp8_rows(out.cpu())  # and so the torch reference's (the quantizer is bitwise it)
    assert torch.equal(acts.scale.cpu(), ref_scale) and torch.equal(acts.x_q.cpu().view(torch.uint8),
                                                                   ref_q.view(torch.uint8))


def _fp8_rows(gen: torch.Generator, rows: int, cols: int, dtype: torch.dtype, extra_cols: int = 0) -> torch.Tensor:
    """Rows of very different ranges (amax from ~1e-3 to ~1e2), an all-zero first row when there are several."""
    x = strided_rows(gen, rows, cols, extra_cols, dtype)
    x.mul_((10.0 ** torch.linspace(-3, 2, rows)).to(dtype).to(DEVICE)[:, None])
    if rows > 1:
        x[0] = 0
    return x


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("rows", FP8_ROWS)
@pytest.mark.parametrize("hidden", [64, 300, 1024])  # several rows per program, a non-power of two, one row each
@pytest.mark.parametrize("residual", [False, True])
def test_fused_fp8_norm_is_the_norm_then_the_quantizer(dtype, rows, hidden, residual):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = _fp8_rows(gen, rows, hidden, dtype, extra_cols=3)  # strided rows
    weight = randn(gen, hidden, dtype=dtype)
    ops = TritonOps()
    if residual:
        res = randn(gen, rows, hidden, dtype=dtype, scale=4.0)
        res_unfused, res_written = res.clone(), res.clone()
        out = ops.fused_add_rms_norm(x, res_unfused, weight, 1e-6)
        acts = ops.fused_add_rms_norm_fp8(x, res, weight, 1e-6)
        written = ops.fused_add_rms_norm_fp8(x, res_written, weight, 1e-6, write_out=True)
        assert torch.equal(res, res_unfused) and torch.equal(res_written, res_unfused)  # residual += x, same bits
    else:
        out = ops.rms_norm(x, weight, 1e-6)
        acts = ops.rms_norm_fp8(x, weight, 1e-6)
        written = ops.rms_norm_fp8(x, weight, 1e-6, write_out=True)
    assert acts.x is None and torch.equal(written.x, out)  # the 16-bit output only when asked, and unchanged
    assert_quantized_as(acts, out)
    assert_quantized_as(written, out)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("rows", FP8_ROWS)
@pytest.mark.parametrize("intermediate, max_block", [(64, 16384), (300, 16384), (1024, 16384), (300, 128)])
@pytest.mark.parametrize("split", [False, True])  # one program per row / two launches over column blocks
def test_fused_fp8_silu_and_mul_is_the_op_then_the_quantizer(dtype, rows, intermediate, max_block, split,
                                                             monkeypatch):
    monkeypatch.setattr(triton_ops, "SILU_FP8_MAX_BLOCK", max_block)  # 128: three chunks, two passes
    monkeypatch.setattr(triton_ops, "SILU_FP8_SPLIT_MAX_ROWS", 64 if split else 0)
    monkeypatch.setattr(triton_ops, "SILU_FP8_SPLIT_MIN_COLS", 1)
    monkeypatch.setattr(triton_ops, "SILU_FP8_SPLIT_BLOCK", min(max_block, 256))  # 300 columns: two blocks
    gen = torch.Generator().manual_seed(rows + intermediate)
    gate_up = _fp8_rows(gen, rows, 2 * intermediate, dtype, extra_cols=5)
    ops = TritonOps()
    out = ops.silu_and_mul(gate_up)
    acts = ops.silu_and_mul_fp8(gate_up)
    written = ops.silu_and_mul_fp8(gate_up, write_out=True)
    assert acts.x is None and torch.equal(written.x, out)
    assert_quantized_as(acts, out)
    assert_quantized_as(written, out)


def test_fused_fp8_fallbacks_quantize_the_torch_op():
    """Layouts the kernels do not take (3-D rows, non-contiguous columns, fp16 weights under bf16 activations)
    go through the unfused op and the quantizer: still the same bits."""
    gen = torch.Generator().manual_seed(3)
    ops, dtype = TritonOps(), torch.bfloat16
    x3 = randn(gen, 2, 3, 40, dtype=dtype)
    weight = randn(gen, 40, dtype=dtype)
    acts = ops.rms_norm_fp8(x3, weight, 1e-6, write_out=True)
    out = ops.rms_norm(x3, weight, 1e-6).reshape(6, 40)
    assert torch.equal(acts.x, out)
    assert_quantized_as(acts, out)
    x = randn(gen, 5, 40, dtype=dtype)
    acts = ops.rms_norm_fp8(x, weight.half(), 1e-6)
    assert_quantized_as(acts, ops.rms_norm(x, weight.half(), 1e-6))
    gate_up = randn(gen, 80, 5, dtype=dtype).t()  # columns not contiguous
    assert_quantized_as(ops.silu_and_mul_fp8(gate_up), ops.silu_and_mul(gate_up))


def test_fp8_linear_takes_the_fused_quantizers_output():
    """``Fp8Linear`` given an ``Fp8Activations`` skips its quantizer and returns what it returns for the 16-bit
    tensor, bit for bit, on the reference path and the W8A16 kernel's (interpreted on CPU; GEMV and tensor-core
    tiles); in mode "none" it multiplies the 16-bit ``x`` the container carries."""
    gen = torch.Generator().manual_seed(9)
    n, k = 48, 96
    w, b = torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen)
    for dtype in FP8_DTYPES:
        for use_triton in (False, True):
            layer = Fp8Linear.from_float(w, b.to(dtype), use_scaled_mm=False, use_triton=use_triton).to(DEVICE)
            for m in (1, 8, 40):  # 40 rows: above W8A16_MAX_ROWS, the reference / _scaled_mm path
                x = randn(gen, m, k, dtype=dtype, scale=3.0)
                acts = TritonOps().rms_norm_fp8(x, torch.ones(k, dtype=dtype, device=DEVICE), 1e-6, write_out=True)
                assert torch.equal(layer(acts), layer(acts.x))
    layer.activation_quant = "none"
    assert torch.equal(layer(acts), layer(acts.x))
    with pytest.raises(ValueError, match="16-bit"):
        layer(Fp8Activations(acts.x_q, acts.scale, acts.dtype))


@torch.inference_mode()
def _tiny_logits(engine, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    hidden, _ = engine.runner.forward(ids, list(range(n)), [n], [n], [list(range(-(-n // 4)))])
    return engine.runner.model.compute_logits(hidden)  # [n, vocab]


class _CountingOps(TritonOps):
    """TritonOps that counts its fused FP8 calls."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def rms_norm_fp8(self, *args, **kwargs):
        self._count("rms_norm_fp8")
        return super().rms_norm_fp8(*args, **kwargs)

    def fused_add_rms_norm_fp8(self, *args, **kwargs):
        self._count("fused_add_rms_norm_fp8")
        return super().fused_add_rms_norm_fp8(*args, **kwargs)

    def silu_and_mul_fp8(self, *args, **kwargs):
        self._count("silu_and_mul_fp8")
        return super().silu_and_mul_fp8(*args, **kwargs)


@pytest.mark.parametrize("use_triton", [False, True])
def test_fp8_tiny_model_logits_identical_with_fused_quantizer(use_triton, monkeypatch):
    """A tiny Llama quantized to FP8 with TritonOps (interpreted on CPU): the same logits, bit for bit, with
    ``quant_tiles.FUSE_FP8_ACT_QUANT`` on (the norms and silu_and_mul hand the projections e4m3 rows) and off,
    whether the projections run the reference maths (CPU) or the W8A16 kernel; off calls no fused op, and
    TorchOps ignores the switch."""
    from tests.tiny import prompts, tiny_engine
    ids = prompts([9])[0]
    engine = tiny_engine(quantization="fp8")
    model = engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert layers
    for layer in layers:
        layer.use_triton = use_triton
    torch_logits = _tiny_logits(engine, ids)  # TorchOps
    monkeypatch.setattr(quant_tiles, "FUSE_FP8_ACT_QUANT", True)
    assert torch.equal(_tiny_logits(engine, ids), torch_logits)  # no fused ops on TorchOps: the switch is inert
    ops = _CountingOps()
    model.set_ops(ops)
    monkeypatch.setattr(quant_tiles, "FUSE_FP8_ACT_QUANT", False)
    off = _tiny_logits(engine, ids)
    assert ops.calls == {}
    monkeypatch.setattr(quant_tiles, "FUSE_FP8_ACT_QUANT", True)
    on = _tiny_logits(engine, ids)
    n_layers = len(model.layers)
    assert ops.calls == {"rms_norm_fp8": 1, "fused_add_rms_norm_fp8": 2 * n_layers - 1,
                         "silu_and_mul_fp8": n_layers}
    assert torch.equal(on, off)
