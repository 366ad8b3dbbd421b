"""Triton kernels for quantized projections (layers/triton_w8a16.py, layers/triton_w4a16.py,
layers/triton_splitk.py, layers/quant_tiles.py), against the plain-torch maths of layers/quant_gpu.py. Without a
GPU they run under Triton's interpreter (tests/triton_interpreter.py), so the shapes stay small.

- W8A16 (e4m3 weights, activations quantized per token inside the kernel, the default) ==
  ``(x_q * x_scale) @ (w_q * w_scale).T`` in fp64 from the fused quantizer's x_q and scales, within fp32
  summation-order tolerance, for M in {1, 3, 16, 17, 32}, odd N, bias or none, bf16 / fp16 / fp32 activations,
  the GEMV and tensor-core paths (the fp8 MMA for pre-quantized activations), in-kernel and pre-quantized
  activations; the in-kernel e4m3 bits == the fused
  quantizer's (identity weights); split K (in-launch reduction: deterministic, counters left zero); the old
  unquantized mode == ``w8a16_linear_reference``.
- Batch invariance: a row through ``Fp8Linear`` alone and in 8 rows (the fp8 MMA), in 32 rows (the fp16 MMA)
  and in 40 rows (the per-token-quantized reference, as _scaled_mm's maths) agrees to fp32 summation order,
  while the unquantized W8A16 mode misses by far more.
- The fused FP8 activation quantizer == ``quantize_fp8_rows`` bit for bit (one- and two-pass rows, zero rows,
  subnormal e4m3 results, bf16 / fp16 / fp32 inputs).
- W4A16's GEMV path (M <= 4 per row tile) and tensor-core path with bias and split K == ``int4_linear_reference``.
- Tile tables: bucket lookup, per-shape entries, ``override``.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from specserve.layers.quant_gpu import (
    Fp8Linear,
    dequantize_fp8_rows,
    fp8_linear_reference,
    int4_linear_reference,
    quantize_fp8_rows,
    quantize_int4,
    w8a16_linear_reference,
)
from specserve.layers.quant_tiles import W8A16_MAX_ROWS, W8A16_TILES, TileConfig, TileTable, override
from tests.rounding import assert_rounded_from

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":  # before anything imports triton: its jit functions read TRITON_INTERPRET when defined
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def kernels():
    """(triton_w8a16, triton_w4a16): compiled on a GPU, interpreted (with the interpreter patches) on CPU."""
    pytest.importorskip("triton")
    from specserve.layers import triton_splitk, triton_w4a16, triton_w8a16
    if DEVICE.type == "cpu":
        from tests.triton_interpreter import fix_interpreter, reload_interpreted_chain
        fix_interpreter()
        _, triton_w8a16, triton_w4a16 = reload_interpreted_chain(
            (triton_splitk, "splitk_reduce"), (triton_w8a16, "_w8a16_kernel"), (triton_w4a16, "_w4a16_kernel"))
    return triton_w8a16, triton_w4a16


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: summation order only; 16-bit: both round an fp32 sum, at most a step or two apart."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=8e-3)


def _fp8_case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w_q, w_scale = quantize_fp8_rows(torch.randn(n, k, generator=gen) / k**0.5)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return (x.to(DEVICE), w_q.to(DEVICE), w_scale.reshape(1, -1).to(DEVICE),
            None if b is None else b.to(DEVICE))


# ---- W8A16 ----------------------------------------------------------------------------------------------------
GEMV = TileConfig(block_n=16, block_k=32, num_warps=4, num_stages=1, use_dot=False)
DOT = TileConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)
FP8_DOT = TileConfig(block_n=16, block_k=64, num_warps=4, num_stages=3, fp8_dot=True)  # e4m3 x e4m3 MMA (mode 2)


# Weight tiles loaded before the PDL wait: two of a program's one-tile K range (the second lies in the next split's
# range and must read as zeros) and one of a two-tile range, on the fp8 MMA and on the fp16 one.
PREFETCHED = (dataclasses.replace(FP8_DOT, block_k=32, split_k=3, prefetch=2),
              dataclasses.replace(DOT, block_k=32, split_k=2, prefetch=1))


# On a GPU the fp8 MMA's partial sums of 32 products keep about 14 bits before fp32 (triton_w8a16's docstring):
# its outputs are checked to 2^-12 of the row's largest output there; the interpreter's fp8 dot is exact.
FP8_MMA_RTOL = 2.0**-12 if DEVICE.type == "cuda" else 1e-5


def _fp64_reference(
    x_q: torch.Tensor,  # [M, K] float8_e4m3fn, the fused quantizer's
    x_scale: torch.Tensor,  # [M, 1] fp32
    w_q: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [1, N] fp32
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] fp64
    out = (x_q.double() @ w_q.double().t()) * x_scale.double() * w_scale.double()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("m", [1, 3, 16, 17, 32])
@pytest.mark.parametrize("dtype, bias", [(torch.bfloat16, True), (torch.float16, False), (torch.float32, True)])
def test_w8a16_per_token_equals_fp64_of_fused_quantizer(kernels, m: int, dtype: torch.dtype, bias: bool) -> None:
    """N = 37: a ragged last N tile; K = 96: three K tiles of 32 (GEMV) / a ragged one of 64 (tensor cores). The
    reference is built from the fused quantizer's e4m3 activations and scales (== ``quantize_fp8_rows``)."""
    w8a16 = kernels[0]
    x, w_q, w_scale, b = _fp8_case(m, 37, 96, dtype, bias, seed=m)
    x = x * 4  # activations of a hidden state's magnitude
    x_q, x_scale = w8a16.quantize_fp8_rows_triton(x)
    ref_q, ref_scale = quantize_fp8_rows(x)
    assert torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(x_scale, ref_scale)
    ref = _fp64_reference(x_q, x_scale, w_q, w_scale, b)
    for cfg in (GEMV, dataclasses.replace(DOT, block_k=64), FP8_DOT,
                dataclasses.replace(FP8_DOT, block_k=32, split_k=3), PREFETCHED[0], PREFETCHED[1]):
        for act_quant in ("per_token", "per_token_prequant"):
            out = w8a16.w8a16_linear(x, w_q, w_scale, b, config=cfg, act_quant=act_quant)
            assert out.dtype == dtype
            fp8_mma = cfg.fp8_dot and act_quant == "per_token_prequant"
            assert_rounded_from(out, ref, FP8_MMA_RTOL if fp8_mma else 1e-5)
    _close(w8a16.w8a16_linear(x, w_q, w_scale, b, config=GEMV), fp8_linear_reference(x, w_q, w_scale, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_w8a16_in_kernel_quantization_is_the_fused_quantizers_bits(kernels, dtype: torch.dtype) -> None:
    """Identity weights (scale 1): each output is one product, ``x_q * x_scale`` exactly, so the kernel's output
    equals the dequantized fused-quantizer result rounded to the activation dtype, bit for bit: scales from
    ~1e-3 to ~1e2, an all-zero row, e4m3 subnormals, a row of exactly +-448 multiples."""
    w8a16 = kernels[0]
    k = 96
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(17, k, generator=gen) * torch.logspace(-3, 2, 17).unsqueeze(1)
    x[3] = 0.0
    x[1, :7] = torch.tensor([1e-4, -3e-4, 2e-3, 448.0, -5.0, 0.0, 7e-3])
    x = x.to(dtype).to(DEVICE)
    w_q = torch.eye(k).to(torch.float8_e4m3fn).to(DEVICE)
    w_scale = torch.ones(1, k, device=DEVICE)
    expect = dequantize_fp8_rows(*w8a16.quantize_fp8_rows_triton(x)).to(dtype)
    for cfg in (GEMV, dataclasses.replace(DOT, block_k=64), dataclasses.replace(GEMV, split_k=3)):
        for rows in (1, 3, 17):
            out = w8a16.w8a16_linear(x[:rows], w_q, w_scale, config=cfg)
            assert torch.equal(out.cpu(), expect[:rows].cpu()), (cfg, rows)


def test_w8a16_unquantized_mode_matches_its_reference(kernels) -> None:
    w8a16 = kernels[0]
    for m, dtype in ((1, torch.bfloat16), (17, torch.float32)):
        x, w_q, w_scale, b = _fp8_case(m, 37, 96, dtype, True, seed=m)
        ref = w8a16_linear_reference(x, w_q, w_scale, b)
        for cfg in (GEMV, dataclasses.replace(DOT, block_k=64)):
            _close(w8a16.w8a16_linear(x, w_q, w_scale, b, config=cfg, act_quant="none"), ref)
    with pytest.raises(ValueError, match="act_quant"):
        w8a16.w8a16_linear(x, w_q, w_scale, act_quant="per_tensor")
    with pytest.raises(ValueError, match="prefetch"):
        w8a16.w8a16_linear(x, w_q, w_scale, config=dataclasses.replace(DOT, prefetch=3))


@pytest.mark.parametrize("cfg", [dataclasses.replace(GEMV, split_k=3), dataclasses.replace(DOT, split_k=2),
                                 dataclasses.replace(DOT, split_k=0), dataclasses.replace(DOT, split_k=2, prefetch=2)])
def test_w8a16_split_k_reduces_in_launch(kernels, cfg: TileConfig) -> None:
    w8a16 = kernels[0]
    x, w_q, w_scale, b = _fp8_case(3, 37, 160, torch.bfloat16, True, seed=7)
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    out = w8a16.w8a16_linear(x, w_q, w_scale, b, config=cfg, counters=counters)
    _close(out, fp8_linear_reference(x, w_q, w_scale, b))
    assert not counters.any()  # the last program of each tile reset its counter
    again = w8a16.w8a16_linear(x, w_q, w_scale, b, config=cfg, counters=counters)
    assert torch.equal(again, out)  # partials are added in split order, whatever the arrival order


def test_w8a16_table_strided_and_empty(kernels) -> None:
    w8a16 = kernels[0]
    x, w_q, w_scale, _ = _fp8_case(2, 24, 64, torch.bfloat16, False)
    wide = torch.cat([x, torch.zeros_like(x)], dim=1)[:, :64]  # row stride 128
    for act_quant in ("per_token", "per_token_prequant"):
        _close(w8a16.w8a16_linear(wide, w_q, w_scale, act_quant=act_quant),
               fp8_linear_reference(x, w_q, w_scale, None))
    assert w8a16.w8a16_linear(x[:0], w_q, w_scale).shape == (0, 24)
    with pytest.raises(ValueError, match="in_features"):
        w8a16.w8a16_linear(x[:, :32], w_q, w_scale)


def test_fp8_linear_uses_the_kernel_for_small_m(kernels) -> None:
    """``use_triton``: rows up to ``max_triton_rows`` run the W8A16 kernel (activations quantized per token; in
    the kernel up to ``W8A16_INKERNEL_QUANT_MAX_ROWS``, else pre-quantized), more rows the same maths through
    the reference here (``use_scaled_mm=False``)."""
    from specserve.layers import quant_tiles
    gen = torch.Generator().manual_seed(4)
    w, b = torch.randn(40, 64, generator=gen) / 8, torch.randn(40, generator=gen)
    layer = Fp8Linear.from_float(w, b, use_scaled_mm=False, use_triton=True).to(DEVICE)
    layer.max_triton_rows = 4
    assert layer.split_counters.dtype == torch.int32 and "split_counters" not in layer.state_dict()
    x = torch.randn(6, 64, generator=gen).to(DEVICE)
    ref = fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.bias)
    # up to 8 rows may run the fp8 MMA: on a GPU its outputs are FP8_MMA_RTOL of the largest output apart
    mma_atol = max(1e-4, FP8_MMA_RTOL * ref[:4].abs().amax().item())
    torch.testing.assert_close(layer(x[:4]), ref[:4], rtol=1e-4, atol=mma_atol)
    saved = quant_tiles.W8A16_INKERNEL_QUANT_MAX_ROWS
    try:
        quant_tiles.W8A16_INKERNEL_QUANT_MAX_ROWS = 2
        torch.testing.assert_close(layer(x[:4]), ref[:4], rtol=1e-4, atol=mma_atol)
    finally:
        quant_tiles.W8A16_INKERNEL_QUANT_MAX_ROWS = saved
    torch.testing.assert_close(layer(x), ref)
    layer.activation_quant = "none"
    _close(layer(x[:4]), w8a16_linear_reference(x[:4], layer.weight, layer.weight_scale, layer.bias))
    with pytest.raises(ValueError, match="activation_quant"):
        Fp8Linear(layer.weight, layer.weight_scale, activation_quant="per_tensor")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_row_does_not_depend_on_the_batch(kernels, dtype: torch.dtype) -> None:
    """Speculative greedy == plain greedy needs a token's logits independent of its step's row count: a row
    alone and among 8 rows (the fp8 MMA), among 32 rows (the fp16-converting MMA, split K) and among 40 rows
    (above W8A16_MAX_ROWS: the per-token-quantized reference, _scaled_mm's maths) agree within fp32 summation
    order (rtol 1e-5 of the row's largest output; for bf16 plus one output rounding), and the contrast is real:
    the unquantized W8A16 mode misses the 40-row result by more than 100 times that tolerance. On a GPU the fp8
    MMA's partial sums of 32 products keep about 14 bits (triton_w8a16's docstring): there rows of up to 8 may
    differ by up to 2^-12 of the row's largest output instead (``FP8_MMA_RTOL``, still inside the contrast)."""
    gen = torch.Generator().manual_seed(21)
    n, k = 37, 160
    w, b = torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen)
    layer = Fp8Linear.from_float(w, b.to(dtype), use_scaled_mm=False, use_triton=True).to(DEVICE)
    x = (torch.randn(40, k, generator=gen) * 3).to(DEVICE, dtype)
    batch = layer(x)  # 40 rows: the reference path
    exact = _fp64_reference(*quantize_fp8_rows(x.cpu()), layer.weight.cpu(), layer.weight_scale.cpu(),
                            layer.bias.cpu())
    tol = assert_rounded_from(batch, exact)
    assert_rounded_from(layer(x[:8]), exact[:8], FP8_MMA_RTOL)  # up to 8 rows: the fp8 MMA
    assert_rounded_from(layer(x[:32]), exact[:32])
    singles = torch.cat([layer(x[i:i + 1]) for i in (0, 5, 39)])
    assert_rounded_from(singles, exact[[0, 5, 39]], FP8_MMA_RTOL)
    if dtype == torch.float32:
        fp8_mma = FP8_MMA_RTOL * batch[[0, 5, 39]].abs().amax().item()
        torch.testing.assert_close(singles, batch[[0, 5, 39]], rtol=0, atol=max(2 * tol, fp8_mma))
    layer.activation_quant = "none"
    old = torch.cat([layer(x[i:i + 1]) for i in (0, 5, 39)])
    assert (old.double() - batch[[0, 5, 39]].double()).abs().max().item() > 100 * tol


# ---- fused FP8 activation quantizer ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k, max_block", [(300, 8192), (300, 128)])  # one pass; two passes over 3 chunks
def test_fused_fp8_quantizer_is_bitwise_torch(kernels, dtype: torch.dtype, k: int, max_block: int) -> None:
    gen = torch.Generator().manual_seed(k + max_block)
    x = torch.randn(5, k, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1e2]).unsqueeze(1)
    x[3] = 0.0  # an all-zero row: scale 1e-12, zeros
    x[1, :7] = torch.tensor([1e-4, -3e-4, 2e-3, 448.0, -5.0, 0.0, 7e-3])  # e4m3 subnormals after scaling
    x = x.to(dtype)
    x_q, scale = kernels[0].quantize_fp8_rows_triton(x.to(DEVICE), max_block=max_block)
    ref_q, ref_scale = quantize_fp8_rows(x)
    assert x_q.dtype == ref_q.dtype and scale.shape == ref_scale.shape == (5, 1)
    assert torch.equal(scale.cpu(), ref_scale)
    assert torch.equal(x_q.cpu().view(torch.uint8), ref_q.view(torch.uint8))


# ---- W4A16 ----------------------------------------------------------------------------------------------------
def _int4_case(m: int, n: int, k: int, group_size: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    qweight, scales, zeros = (t.to(DEVICE) for t in quantize_int4(w, group_size, dtype))
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, qweight, scales, zeros, b


@pytest.mark.parametrize("m, dtype, split_k", [(1, torch.bfloat16, 1), (2, torch.float32, 3), (4, torch.float32, 0),
                                               (5, torch.bfloat16, 2)])
def test_w4a16_gemv_matches_reference(kernels, m: int, dtype: torch.dtype, split_k: int) -> None:
    """The GEMV path (one row tile of up to 4 rows; M = 5 takes two), groups of 64, bias, split K. The GEMV keeps
    the dequantized weights in fp32 (the reference rounds them to the activation dtype), so bf16 compares loosely."""
    x, qweight, scales, zeros, b = _int4_case(m, 37, 256, 64, dtype, bias=True, seed=m)
    cfg = TileConfig(block_n=16, block_k=64, num_warps=4, num_stages=1, split_k=split_k, use_dot=False)
    out = kernels[1].w4a16_linear(x, qweight, scales, zeros, b, config=cfg)
    ref = int4_linear_reference(x, qweight, scales, zeros, b)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=1.6e-2)


def test_w4a16_dot_bias_epilogue_and_split(kernels) -> None:
    x, qweight, scales, zeros, b = _int4_case(17, 40, 256, 128, torch.float32, bias=True, seed=3)
    counters = torch.zeros(32, dtype=torch.int32, device=DEVICE)
    cfg = TileConfig(block_n=32, block_k=64, num_warps=4, num_stages=2, split_k=4, block_m=16)
    out = kernels[1].w4a16_linear(x, qweight, scales, zeros, b, config=cfg, counters=counters)
    torch.testing.assert_close(out, int4_linear_reference(x, qweight, scales, zeros, b), atol=1e-4, rtol=1e-4)
    assert not counters.any()


# ---- tile tables ----------------------------------------------------------------------------------------------
def test_tile_table_buckets_shapes_and_override() -> None:
    a, b, c = TileConfig(16, 512, use_dot=False), TileConfig(64, 128), TileConfig(128, 64)
    table = TileTable(by_rows={1: a, 16: b}, by_shape={(6144, 4096): {4: c}})
    assert table.lookup(1, 4096, 4096) is a and table.lookup(2, 4096, 4096) is b
    assert table.lookup(500, 4096, 4096) is b  # past the last bucket: the last entry
    assert table.lookup(1, 6144, 4096) is c and table.lookup(9, 6144, 4096) is c
    with override(table, by_rows={8: c}, by_shape={}):
        assert table.lookup(1, 6144, 4096) is c and table.lookup(100, 1, 1) is c
    assert table.lookup(1, 4096, 4096) is a and table.lookup(1, 6144, 4096) is c
    decode = W8A16_TILES.lookup(1, 4096, 4096)  # decode rows: the fp8 MMA on the fused ops' e4m3 activations
    assert decode.use_dot and decode.fp8_dot
    # ... and every row count up to W8A16_MAX_ROWS (batch-32 decode, an 8-token verify at batch 4) takes it too
    assert all(W8A16_TILES.lookup(m, 4096, 4096).fp8_dot for m in range(1, W8A16_MAX_ROWS + 1))
    assert "use_dot=False" in a.describe() and eval(a.describe()) == a  # describe() pastes back as code
    assert eval(decode.describe()) == decode
