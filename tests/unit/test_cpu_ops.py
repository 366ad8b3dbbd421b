"""The fused CPU ops (specserve/kernels/cpu_ops.cpp) equal the plain torch expressions they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.layers import cpu_ops


@pytest.fixture(autouse=True, scope="module")
def _kernel_built() -> None:
    # The CI machine has a compiler: a kernel that fails to build there is a failure, not a skip.
    assert cpu_ops.load_ops_extension() is not None, "the fused CPU ops extension did not build (see the log)"

HYPOTHESIS = settings(max_examples=40, deadline=None)


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-6, atol: float = 1e-30) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def rows_view(num_rows: int, cols: int, extra_cols: int, offset: int, gen: torch.Generator) -> torch.Tensor:
    """A [num_rows, cols] view into a wider matrix (row stride cols + extra_cols) when extra_cols > 0."""
    base = torch.randn(num_rows, cols + extra_cols, generator=gen) * 3
    offset = min(offset, extra_cols)
    return base[:, offset:offset + cols]


@HYPOTHESIS
@given(num_rows=st.integers(1, 40), hidden=st.sampled_from([1, 7, 8, 33, 64, 576, 600]),
       extra_cols=st.sampled_from([0, 5, 64]), seed=st.integers(0, 2**16), eps=st.sampled_from([1e-5, 1e-6]))
def test_rms_norm(num_rows, hidden, extra_cols, seed, eps):
    gen = torch.Generator().manual_seed(seed)
    x = rows_view(num_rows, hidden, extra_cols, 3, gen)
    weight = torch.randn(hidden, generator=gen)
    out = cpu_ops.rms_norm(x, weight, eps)
    assert_close(out, ref_rms_norm(x, weight, eps))
    assert_close(out, F.rms_norm(x, (hidden,), weight, eps))


@HYPOTHESIS
@given(num_rows=st.integers(1, 40), hidden=st.sampled_from([1, 9, 16, 576, 1000]),
       extra_cols=st.sampled_from([0, 7]), seed=st.integers(0, 2**16))
def test_fused_add_rms_norm(num_rows, hidden, extra_cols, seed):
    gen = torch.Generator().manual_seed(seed)
    x = rows_view(num_rows, hidden, extra_cols, 2, gen)
    residual = torch.randn(num_rows, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    expected_residual = residual + x
    expected = ref_rms_norm(expected_residual, weight, 1e-5)
    out = cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)  # the add is exact, and in place
    assert_close(out, expected)


@HYPOTHESIS
@given(num_rows=st.integers(1, 40), intermediate=st.sampled_from([1, 5, 8, 24, 1536]),
       extra_cols=st.sampled_from([0, 3]), seed=st.integers(0, 2**16))
def test_silu_and_mul(num_rows, intermediate, extra_cols, seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up = rows_view(num_rows, 2 * intermediate, extra_cols, 1, gen)
    expected = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    assert_close(cpu_ops.silu_and_mul(gate_up), expected, rtol=2e-6, atol=1e-7)


def test_silu_and_mul_extremes():
    gate = torch.tensor([-1000.0, -100.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 100.0, 1000.0] * 2)
    gate_up = torch.stack([torch.cat([gate, torch.full_like(gate, 1.5)])] * 3)
    out = cpu_ops.silu_and_mul(gate_up)
    assert torch.isfinite(out).all()
    assert_close(out, F.silu(gate_up[:, :gate.numel()]) * 1.5, rtol=2e-6, atol=1e-30)


@HYPOTHESIS
@given(num_rows=st.integers(1, 40), num_heads=st.integers(1, 12), head_dim=st.sampled_from([2, 8, 16, 24, 64, 128]),
       extra_heads=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_rope_rotate_half_on_qkv_view(num_rows, num_heads, head_dim, extra_heads, seed):
    """qk is the q|k part of a fused qkv matrix: a view whose row stride exceeds heads * head_dim."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_rows, (num_heads + extra_heads) * head_dim, generator=gen)
    positions = torch.randint(0, 4096, (num_rows,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    qk = qkv[:, :num_heads * head_dim].view(num_rows, num_heads, head_dim)
    untouched = qkv[:, num_heads * head_dim:].clone()
    expected = ref_rope(qk.clone(), cos, sin)
    result = cpu_ops.rope_rotate_half_(qk, cos, sin)
    assert result.data_ptr() == qk.data_ptr()
    assert torch.equal(qk, expected)  # same mul/add roundings as torch: bit-exact
    assert torch.equal(qkv[:, num_heads * head_dim:], untouched)


def test_rope_head_strided_view():
    """Heads taken out of order from a [N, H, D] tensor (head stride != D) and 3-D cos/sin as RotaryEmbedding gives."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, 64, generator=gen)
    cos = torch.randn(5, 1, 64, generator=gen)
    sin = torch.randn(5, 1, 64, generator=gen)
    view = x[:, ::2]
    expected = ref_rope(view.clone(), cos.squeeze(1), sin.squeeze(1))
    other = x[:, 1::2].clone()
    cpu_ops.rope_rotate_half_(view, cos, sin)
    assert torch.equal(x[:, ::2], expected)
    assert torch.equal(x[:, 1::2], other)


def test_large_inputs_use_threads_and_agree():
    """Sizes past the parallel threshold (the at::parallel_for path)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    assert_close(cpu_ops.rms_norm(x, weight, 1e-5), ref_rms_norm(x, weight, 1e-5))
    gate_up = torch.randn(300, 3072, generator=gen)
    assert_close(cpu_ops.silu_and_mul(gate_up), F.silu(gate_up[:, :1536]) * gate_up[:, 1536:], rtol=2e-6, atol=1e-7)
    qk = torch.randn(300, 12, 64, generator=gen)
    cos, sin = torch.randn(300, 64, generator=gen), torch.randn(300, 64, generator=gen)
    expected = ref_rope(qk.clone(), cos, sin)
    cpu_ops.rope_rotate_half_(qk, cos, sin)
    assert torch.equal(qk, expected)


def test_leading_dims_and_errors():
    x = torch.randn(2, 3, 16)
    weight = torch.randn(16)
    assert_close(cpu_ops.rms_norm(x, weight, 1e-6), ref_rms_norm(x, weight, 1e-6))
    assert cpu_ops.silu_and_mul(torch.randn(2, 3, 8)).shape == (2, 3, 4)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.rms_norm(x.double(), weight, 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_ops.rms_norm(x, torch.randn(15), 1e-6)
    with pytest.raises(RuntimeError, match="unit stride"):
        cpu_ops.rms_norm(torch.randn(16, 4).t(), torch.randn(4), 1e-6)
    with pytest.raises(ValueError, match="differ"):
        cpu_ops.fused_add_rms_norm(x, torch.randn(2, 3, 8), weight, 1e-6)
