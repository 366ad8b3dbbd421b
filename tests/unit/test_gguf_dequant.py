"""Our torch dequantisation of GGUF block formats equals gguf-py's numpy reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specserve.models.gguf_loader import dequantize

Q = gguf.GGMLQuantizationType

# byte offsets of the f16 scale fields inside one block of each format
_F16_FIELDS = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q5_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


def _random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes for ``rows`` rows, with every f16 scale set to a finite value in [-2, 2]."""
    rng = np.random.default_rng(seed)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for offset in _F16_FIELDS[qtype]:
        scales = rng.uniform(-2, 2, size=rows * blocks_per_row).astype(np.float16)
        data[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, blocks_per_row * type_size)


def _reference(raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32))


@pytest.mark.parametrize("qtype", list(_F16_FIELDS), ids=lambda q: q.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_formats_match_reference(qtype: gguf.GGMLQuantizationType, seed: int) -> None:
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 7, 3
    raw = _random_blocks(qtype, rows, blocks_per_row, seed)
    ours = dequantize(raw, qtype, (rows, blocks_per_row * block_size))
    ref = _reference(raw, qtype)
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape == (rows, blocks_per_row * block_size)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_float_formats_match_reference(qtype: gguf.GGMLQuantizationType) -> None:
    values = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * 10
    torch_dtype = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
    raw = values.to(torch_dtype).view(torch.uint8).numpy()  # bytes, as gguf stores them
    ours = dequantize(raw, qtype, (5, 64))
    torch.testing.assert_close(ours, _reference(raw, qtype).reshape(5, 64), rtol=0, atol=0)
    torch.testing.assert_close(ours, values.to(torch_dtype).float(), rtol=0, atol=0)
    if qtype == Q.F32:  # the typed array gguf's reader hands out works too
        assert torch.equal(dequantize(values.numpy(), qtype, (5, 64)), values)


def test_unsupported_type_names_it() -> None:
    raw = np.zeros(84, dtype=np.uint8)  # one Q2_K block
    with pytest.raises(NotImplementedError, match="Q2_K"):
        dequantize(raw, Q.Q2_K, (256,))


def test_wrong_byte_count_is_an_error() -> None:
    raw = np.zeros(33, dtype=np.uint8)
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(raw, Q.Q8_0, (32,))


def test_every_tensor_of_smollm2_matches_reference(smollm2_gguf_path) -> None:
    reader = gguf.GGUFReader(str(smollm2_gguf_path))
    seen = set()
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        ours = dequantize(t.data, t.tensor_type, shape)
        ref = _reference(t.data, t.tensor_type).reshape(shape)
        assert torch.equal(ours, ref), t.name
        seen.add(t.tensor_type)
    assert seen == {Q.Q4_1, Q.Q8_0, Q.F32}
