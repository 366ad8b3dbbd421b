"""The CPU GEMM from GGUF blocks (Q4_1, Q8_0) equals x @ dequantize().T, and dequantize() equals gguf-py's.

With int8 activations (``activation_quant="q8"``): the kernel's quantization of x equals the torch reference bit for
bit, its GEMM equals ``dequantize() @ (dx * xq)`` to float32 rounding, each row's result does not depend on the other
rows of the call (bit for bit), and the error against float32 activations stays within the bound the rounding of x
implies."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.config import EngineConfig
from specserve.layers.quant_cpu import (
    BLOCK_BYTES,
    QuantizedWeight,
    load_extension,
    q8_reference,
    quant_linear,
    quantize_q8_reference,
)

GGML_TYPE = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}
QTYPES = list(GGML_TYPE)


def random_blocks(qtype: str, rows: int, in_features: int, seed: int) -> np.ndarray:  # [rows, row_bytes] uint8
    """Random codes with finite, sane f16 scales: d in +-[1e-3, 0.1] (either sign), m in [-1, 1]."""
    rng = np.random.default_rng(seed)
    groups = in_features // 32
    raw = rng.integers(0, 256, size=(rows, groups, BLOCK_BYTES[qtype]), dtype=np.uint8)
    d = rng.uniform(1e-3, 0.1, size=(rows, groups, 1)) * rng.choice([-1, 1], size=(rows, groups, 1))
    raw[..., 0:2] = d.astype(np.float16).view(np.uint8)
    if qtype == "q4_1":
        raw[..., 2:4] = rng.uniform(-1, 1, size=(rows, groups, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, groups * BLOCK_BYTES[qtype])


def gguf_reference(raw: np.ndarray, qtype: str) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, GGML_TYPE[qtype]), dtype=np.float32))


def assert_matmul_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|y - x @ w.T| <= 1e-4 * (|x| @ |w|.T): 1e-4 relative to the size of the terms summed (cancellation-safe)."""
    expected = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    err = (y.double() - expected).abs()
    assert y.shape == expected.shape and y.dtype == torch.float32
    assert bool((err <= 1e-4 * scale + 1e-30).all()), f"max relative error {(err / scale.clamp_min(1e-30)).max():.3g}"


@pytest.fixture(scope="module")
def kernel():
    ext = load_extension()
    assert ext is not None, "the quantized CPU kernel did not build (see the log)"
    return ext


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("in_features", [32, 576, 1536])
@pytest.mark.parametrize("out_features", [1, 7, 192, 1000])
def test_dequantize_equals_gguf(qtype, in_features, out_features):
    raw = random_blocks(qtype, out_features, in_features, seed=in_features + out_features)
    w = QuantizedWeight.from_gguf_bytes(raw, qtype, out_features, in_features)
    assert torch.equal(w.dequantize(), gguf_reference(raw, qtype).reshape(out_features, in_features))
    groups = in_features // 32
    assert w.nbytes == out_features * groups * (16 + 8 if qtype == "q4_1" else 32 + 4)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("in_features", [32, 576, 1536])
@pytest.mark.parametrize("out_features", [1, 7, 192, 1000])
@pytest.mark.parametrize("num_rows", [1, 3, 8, 33])
def test_kernel_matches_dequantized_matmul(kernel, qtype, in_features, out_features, num_rows):
    raw = random_blocks(qtype, out_features, in_features, seed=7 * in_features + out_features)
    w = QuantizedWeight.from_gguf_bytes(raw, qtype, out_features, in_features)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(num_rows))
    assert_matmul_close(quant_linear(x, w), x, w.dequantize())


@pytest.mark.parametrize("qtype", QTYPES)
def test_bias_leading_dims_and_threads(kernel, qtype):
    raw = random_blocks(qtype, 96, 64, seed=1)
    w = QuantizedWeight.from_gguf_bytes(raw, qtype, 96, 64)
    x = torch.randn(2, 5, 64)
    bias = torch.randn(96)
    y = quant_linear(x, w, bias)
    assert y.shape == (2, 5, 96)
    assert_matmul_close(y.reshape(10, 96) - bias, x.reshape(10, 64), w.dequantize())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant_linear(x, w, bias), y)  # each output is computed by one thread: same sums
    finally:
        torch.set_num_threads(threads)
    strided = torch.randn(10, 128)[:, ::2]  # 2D float32 takes the direct path: strides are the kernel's to handle
    for act in ("none", "q8"):
        assert torch.equal(quant_linear(strided, w, None, act), quant_linear(strided.contiguous(), w, None, act))
    assert quant_linear(x.double(), w, bias).dtype == torch.float64


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_and_cat(kernel, qtype):
    parts = [QuantizedWeight.from_gguf_bytes(random_blocks(qtype, n, 96, seed=n), qtype, n, 96) for n in (5, 3, 8)]
    fused = QuantizedWeight.cat(parts)
    assert fused.shape == (16, 96)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    index = torch.tensor([15, 0, 3, 3, 9, 1])  # any order, repeats allowed
    picked = fused.rows(index)
    assert picked.shape == (6, 96)
    assert torch.equal(picked.dequantize(), fused.dequantize()[index])
    x = torch.randn(4, 96)
    assert torch.equal(quant_linear(x, picked), quant_linear(x, fused)[:, index])


def test_validation():
    raw = random_blocks("q4_1", 4, 64, seed=0)
    with pytest.raises(ValueError, match="bytes"):
        QuantizedWeight.from_gguf_bytes(raw, "q4_1", 5, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight.from_gguf_bytes(raw, "q4_1", 4, 48)
    with pytest.raises(ValueError, match="unsupported"):
        QuantizedWeight.from_gguf_bytes(raw, "q5_0", 4, 64)  # type: ignore[arg-type]
    w = QuantizedWeight.from_gguf_bytes(raw, "q4_1", 4, 64)
    with pytest.raises(ValueError, match="cannot cat"):
        QuantizedWeight.cat([w, QuantizedWeight.from_gguf_bytes(random_blocks("q8_0", 4, 64, 0), "q8_0", 4, 64)])


@pytest.mark.parametrize("name, qtype", [("blk.0.ffn_up.weight", "q4_1"), ("token_embd.weight", "q8_0")])
def test_real_smollm2_tensors(kernel, smollm2_gguf_path, name, qtype):
    reader = gguf.GGUFReader(smollm2_gguf_path)
    tensor = next(t for t in reader.tensors if t.name == name)
    assert tensor.tensor_type == GGML_TYPE[qtype]
    in_features, out_features = (int(v) for v in tensor.shape)  # GGUF lists dims fastest-first
    raw = np.asarray(tensor.data)
    w = QuantizedWeight.from_gguf_bytes(raw, qtype, out_features, in_features)
    dense = w.dequantize()
    assert torch.equal(dense, gguf_reference(raw, qtype).reshape(out_features, in_features))
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(0))
    assert_matmul_close(quant_linear(x, w), x, dense)


# ---- int8 activations ----------------------------------------------------------------------------------------

def weight(qtype: str, out_features: int, in_features: int, seed: int) -> QuantizedWeight:
    return QuantizedWeight.from_gguf_bytes(random_blocks(qtype, out_features, in_features, seed), qtype,
                                           out_features, in_features)


def activations(num_rows: int, in_features: int, seed: int) -> torch.Tensor:  # [num_rows, in_features]
    """Random rows with the awkward cases: an all-zero block, an outlier block, a block of exact .5 ties."""
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0
    if in_features >= 64:
        x[-1, 32:64] *= 1e3
    if num_rows > 1:  # amax 127 makes dx 1 and 1 / dx 1: x * (1 / dx) lands on .5 exactly (rounds half to even)
        x[1, :32] = torch.arange(32) - 15.5
        x[1, 0] = 127.0
    return x


def test_quantize_equals_torch_reference(kernel) -> None:
    x = activations(7, 2112, seed=0)
    xq, dx, xs = kernel.quantize_q8(x)
    ref_xq, ref_dx = quantize_q8_reference(x)
    assert xq.dtype == torch.int8 and torch.equal(xq.float().reshape(ref_xq.shape), ref_xq)
    assert torch.equal(dx, ref_dx)
    assert torch.equal(xs, ref_dx * ref_xq.sum(-1))
    assert int(xq.abs().max()) == 127 and torch.equal(dx[0, 0], torch.tensor(0.0))
    assert xq[1, 1:5].tolist() == [-14, -14, -12, -12]  # -14.5 -> -14, -13.5 -> -14, -12.5 -> -12, -11.5 -> -12


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 6, 7, 8, 9])
@pytest.mark.parametrize("out_features, in_features", [(1, 32), (7, 96), (37, 576), (193, 1536), (5, 2112)])
def test_kernel_equals_integer_reference(kernel, qtype, num_rows, out_features, in_features) -> None:
    w = weight(qtype, out_features, in_features, seed=num_rows + in_features)
    x = activations(num_rows, in_features, seed=num_rows)
    y = quant_linear(x, w, activation_quant="q8")
    xq, dx = quantize_q8_reference(x)
    x_hat = (xq.double() * dx.double().unsqueeze(-1)).reshape(num_rows, in_features)
    scale = x_hat.abs() @ w.dequantize().double().abs().T  # sizes of the terms summed (cancellation-safe)
    err = (y.double() - q8_reference(x, w)).abs()
    assert y.shape == (num_rows, out_features) and y.dtype == torch.float32
    assert bool((err <= 1e-5 * scale + 1e-30).all()), f"max relative error {(err / scale.clamp_min(1e-30)).max():.3g}"


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("in_features", [96, 576, 2112])
def test_row_alone_equals_row_in_batch(kernel, qtype, in_features) -> None:
    w = weight(qtype, 61, in_features, seed=3)
    x = activations(40, in_features, seed=4)
    alone = torch.cat([quant_linear(x[i:i + 1], w, activation_quant="q8") for i in range(40)])
    for num_rows in [*range(1, 17), 40]:  # every tile shape (1..8 rows), 8-row tiles plus a rest, a prefill chunk
        assert torch.equal(quant_linear(x[:num_rows], w, activation_quant="q8"), alone[:num_rows]), num_rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant_linear(x, w, activation_quant="q8"), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", QTYPES)
def test_error_vs_fp32_activations_within_rounding_bound(kernel, qtype) -> None:
    """Rounding x to int8 moves each element by at most dx / 2 = max|x in its block| / 254, so
    |y_q8 - y| <= sum_k |w[n, k]| * max|x in k's block| / 254 (plus float32 rounding)."""
    w = weight(qtype, 97, 576, seed=5)
    x = activations(5, 576, seed=6)
    dense = w.dequantize().double()
    block_max = x.abs().reshape(5, -1, 32).amax(-1).repeat_interleave(32, dim=-1).double()  # [5, 576]
    bound = block_max @ dense.abs().T / 254 + 1e-5 * (x.double().abs() @ dense.abs().T)
    err = (quant_linear(x, w, activation_quant="q8").double() - x.double() @ dense.T).abs()
    assert bool((err <= bound).all())


def test_bias_and_leading_dims(kernel) -> None:
    w = weight("q4_1", 24, 64, seed=7)
    x = torch.randn(2, 3, 64)
    bias = torch.randn(24)
    y = quant_linear(x, w, bias, activation_quant="q8")
    assert y.shape == (2, 3, 24)
    assert torch.equal(y, quant_linear(x.reshape(6, 64), w, activation_quant="q8").reshape(2, 3, 24) + bias)


def test_q8_activations_take_the_kernel_at_every_row_count() -> None:
    from specserve.layers.linear import QUANT_MAX_ROWS, use_quant_kernel
    assert use_quant_kernel(QUANT_MAX_ROWS, "none") and not use_quant_kernel(QUANT_MAX_ROWS + 1, "none")
    assert use_quant_kernel(1, "q8") and use_quant_kernel(4096, "q8")


def test_bad_activation_quant_is_rejected(kernel) -> None:
    with pytest.raises(ValueError, match="activation_quant"):
        quant_linear(torch.randn(1, 32), weight("q8_0", 2, 32, seed=0), activation_quant="q4")  # type: ignore[arg-type]


def test_config_validates_cpu_activation_quant() -> None:
    assert EngineConfig().cpu_activation_quant == "none"
    assert EngineConfig(cpu_activation_quant="q8").cpu_activation_quant == "q8"
    with pytest.raises(ValueError, match="^cpu_activation_quant: must be one of none, q8"):
        EngineConfig(cpu_activation_quant="int8")
    with pytest.raises(ValueError, match="^cpu_activation_quant: needs quantized_cpu_kernels"):
        EngineConfig(cpu_activation_quant="q8", quantized_cpu_kernels=False)


# ---- quantizing float weights (QuantizedWeight.from_float: an EAGLE head's projections on CPU) ------------------

@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), groups=st.integers(1, 6), scale=st.floats(0.01, 100.0), seed=st.integers(0, 2**16),
       outlier=st.booleans())
def test_from_float_q8_0_stays_within_half_a_step_per_block(rows, groups, scale, seed, outlier) -> None:
    """Q8_0 of a float weight: each weight comes back within ~half a quantization step (max|w| / 127 of its block,
    plus the f16 rounding of that step), whatever the weights' scale (steps in f16's normal range: blocks with
    max|w| >= ~8e-3), also with one outlier per row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, groups * 32, generator=g) * scale
    if outlier:
        w[:, 0] *= 50
    q = QuantizedWeight.from_float(w, "q8_0")
    assert (q.qtype, q.shape) == ("q8_0", (rows, groups * 32))
    deq = q.dequantize()
    step = w.reshape(rows, groups, 32).abs().amax(dim=-1, keepdim=True) / 127  # [rows, groups, 1]
    err = (deq - w).reshape(rows, groups, 32).abs()
    assert bool((err <= 0.5 * step * (1 + 127 * 2**-10) + 1e-30).all()), float((err / step).max())


def test_from_float_q8_0_runs_in_the_kernel_like_its_dequantized_weight(kernel) -> None:
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(300, 576, generator=g), torch.randn(5, 576, generator=g)
    q = QuantizedWeight.from_float(w, "q8_0")
    assert_matmul_close(quant_linear(x, q), x, q.dequantize())
    with pytest.raises(ValueError, match="in_features"):
        QuantizedWeight.from_float(torch.randn(4, 40), "q8_0")
