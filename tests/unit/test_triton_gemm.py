"""The Triton 16-bit tensor-core GEMM (layers/triton_gemm.py) and its per-shape routing (layers/linear.dense_linear,
``quant_tiles.BF16_GEMM_TILES`` / ``bf16_gemm_config``). Without a GPU the kernel runs under Triton's interpreter
(tests/triton_interpreter.py), so the shapes stay small.

- ``gemm_linear`` == ``x @ W.T (+ bias)`` in fp64 up to fp32 summation order and one rounding, through the pointer
  loads and through TMA descriptors, for M not a multiple of BLOCK_M (ragged row tile, M < BLOCK_M), N ragged,
  K not a multiple of BLOCK_K, bias or none, bf16 / fp16 / float32 output, several row-tile groups.
- ``bf16_gemm_config``: buckets, the minimum row count, None entries, shapes without an entry.
- Routing: rows of a listed shape in a listed bucket go to the kernel; other rows and shapes keep ``F.linear``
  exactly.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from specserve.layers import linear as linear_mod
from specserve.layers import quant_tiles
from specserve.layers.quant_tiles import TileConfig, bf16_gemm_config
from tests.rounding import assert_rounded_from, fp64_linear, linear_case

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":  # before anything imports triton: its jit functions read TRITON_INTERPRET when defined
    os.environ["TRITON_INTERPRET"] = "1"

PTR = TileConfig(block_n=32, block_k=32, num_warps=4, num_stages=2, block_m=16, group_m=2)
TMA = TileConfig(block_n=32, block_k=32, num_warps=4, num_stages=2, block_m=16, group_m=2, tma=True)


@pytest.fixture(scope="module")
def gemm():
    """triton_gemm: compiled on a GPU, interpreted (with the interpreter patches) on CPU."""
    pytest.importorskip("triton")
    from specserve.layers import triton_gemm
    if DEVICE.type == "cpu":
        from tests.triton_interpreter import fix_interpreter, reload_interpreted_chain
        fix_interpreter()
        (triton_gemm,) = reload_interpreted_chain((triton_gemm, "_gemm_kernel"))
    return triton_gemm


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    return linear_case(m, n, k, dtype, bias, seed, DEVICE)


@pytest.mark.parametrize("cfg", [PTR, TMA], ids=["pointers", "tma"])
@pytest.mark.parametrize("m", [5, 16, 50])
@pytest.mark.parametrize("dtype, bias", [(torch.bfloat16, True), (torch.float16, False)])
def test_gemm_equals_fp64_reference(gemm, cfg: TileConfig, m: int, dtype: torch.dtype, bias: bool) -> None:
    """N = 70: two full column tiles of 32 and a ragged one; K = 72: a ragged last K tile (EVEN_K off, TMA zero
    fill) and K = 96 (EVEN_K on). M = 50: four row tiles of 16 in two groups of 2, the last ragged; M = 5: fewer
    rows than a tile."""
    for k in (72, 96):
        x, w, b = _case(m, 70, k, dtype, bias, seed=m + k)
        out = gemm.gemm_linear(x, w, b, config=cfg)
        assert out.dtype == dtype and out.shape == (m, 70)
        assert_rounded_from(out, fp64_linear(x, w, b))


@pytest.mark.parametrize("cfg", [PTR, TMA], ids=["pointers", "tma"])
def test_gemm_float_out_keeps_the_fp32_sums(gemm, cfg: TileConfig) -> None:
    """``out_dtype=torch.float32`` (the LM head): the fp32 sums unrounded (the fp64 bound at fp32's half ulp)."""
    x, w, _ = _case(33, 40, 64, torch.bfloat16, False, seed=5)
    out = gemm.gemm_linear(x, w, config=cfg, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_rounded_from(out, fp64_linear(x, w, None))
    assert not torch.equal(out, out.to(torch.bfloat16).float())


def test_gemm_strided_x_falls_back_from_tma(gemm) -> None:
    """x a column slice of a wider tensor (row stride 66 elements = 132 bytes, not 16-byte aligned): the TMA
    configuration runs the pointer path instead, same maths."""
    wide, w, b = _case(20, 24, 66, torch.bfloat16, True, seed=3)
    x = wide[:, 1:65]  # [20, 64]
    w = w[:, :64].contiguous()
    assert not gemm._tma_ok(x)
    assert_rounded_from(gemm.gemm_linear(x, w, b, config=TMA), fp64_linear(x, w, b))


def test_gemm_rejects_mismatched_operands(gemm) -> None:
    x, w, _ = _case(4, 8, 32, torch.bfloat16, False)
    with pytest.raises(ValueError, match="bf16 / fp16"):
        gemm.gemm_linear(x.float(), w, config=PTR)
    with pytest.raises(ValueError, match="in_features"):
        gemm.gemm_linear(x[:, :16], w, config=PTR)
    with pytest.raises(ValueError, match="no BF16_GEMM_TILES entry"):
        gemm.gemm_linear(x, w)
    assert gemm.gemm_linear(x[:0], w, config=PTR).shape == (0, 8)


def test_bf16_gemm_config_buckets(monkeypatch) -> None:
    a, b = TileConfig(64, 64, block_m=64), TileConfig(128, 64, block_m=128)
    monkeypatch.setattr(quant_tiles, "BF16_GEMM_MIN_ROWS", 64)
    monkeypatch.setattr(quant_tiles, "BF16_GEMM_TILES", {(256, 128): {128: None, 256: b}, (64, 128): {128: a}})
    assert [bf16_gemm_config(m, 256, 128) for m in (64, 65, 128, 129, 256, 257)] == [None, None, None, b, b, None]
    assert [bf16_gemm_config(m, 64, 128) for m in (64, 65, 128, 129)] == [None, a, a, None]
    assert bf16_gemm_config(128, 128, 256) is None  # the transposed shape has no entry


def test_routing_takes_listed_shapes_and_buckets_only(gemm, monkeypatch) -> None:
    """With a table entry for (70, 64) rows 33..64 go to the kernel (the fp64 bound holds); 32 and 65 rows, and an
    unlisted shape, give exactly ``F.linear``'s result; with the table empty (the default) nothing is routed."""
    monkeypatch.setattr(linear_mod, "GEMV_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(quant_tiles, "BF16_GEMV_MAX_ROWS", 0)
    monkeypatch.setattr(quant_tiles, "BF16_GEMM_MIN_ROWS", 32)
    calls: list = []
    real = gemm.gemm_linear
    monkeypatch.setattr(gemm, "gemm_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    torch.manual_seed(0)
    layer = linear_mod.Linear(64, 70, bias=True).to(torch.bfloat16).to(DEVICE)
    other = torch.randn(40, 64, device=DEVICE).to(torch.bfloat16)
    with torch.no_grad():
        monkeypatch.setattr(quant_tiles, "BF16_GEMM_TILES", {})
        x = torch.randn(48, 64, device=DEVICE).to(torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        monkeypatch.setattr(quant_tiles, "BF16_GEMM_TILES", {(70, 64): {64: PTR}})
        for m in (32, 33, 64, 65):
            x = torch.randn(m, 64, device=DEVICE).to(torch.bfloat16)
            out = layer(x)
            if 32 < m <= 64:
                assert_rounded_from(out, fp64_linear(x, layer.weight, layer.bias))
            else:
                assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
            assert torch.equal(linear_mod.dense_linear(x, other), F.linear(x, other))
        logits = linear_mod.dense_linear(x[:40], layer.weight, float_out=True)
    assert calls == [33, 64, 40]
    assert logits.dtype == torch.float32
    assert_rounded_from(logits, fp64_linear(x[:40], layer.weight, None))
