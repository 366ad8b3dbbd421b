"""The CPU GEMM from GGUF blocks (Q4_1, Q8_0) equals x @ dequantize().T, and dequantize() equals gguf-py's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specserve.layers.quant_cpu import BLOCK_BYTES, QuantizedWeight, load_extension, quant_linear

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
