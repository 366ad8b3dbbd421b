"""The Triton 16-bit tensor-core GEMM (layers/triton_gemm.py) and its per-shape routing (layers/linear.dense_linear,
``quant_tiles.BF16_GEMM_TILES`` / ``bf16_gemm_config``). Without a GPU the kernel runs under Triton's interpreter
(tests/triton_interpreter.py), so the shapes stay small.

- ``gemm_linear`` == ``x @ W.T (+ bias)`` in fp64 up to fp32 summation order and one rounding, through the pointer
  loads and through TMA descriptors, for M not a multiple of BLOCK_M (ragged row tile, M < BLOCK_M), N ragged,
  K not a multiple of BLOCK_K, bias or none, bf16 / fp16 / float32 output, several row-tile groups.
- The stream-K schedule (``TileConfig.stream_k``): the same fp64 bound for any number of programs (tiles shared by
  two or more programs, programs whose range lies inside one tile, one iteration per program), bit-identical
  repeats (the partials are added in contributor order, not arrival order), the arrival counters left zeroed, a
  counter buffer too small for the launch left untouched; a hypothesis property over shapes, tiles and programs.
- ``bf16_gemm_config``: buckets, the minimum row count, None entries, shapes without an entry.
- Routing: rows of a listed shape in a listed bucket go to the kernel; other rows and shapes keep ``F.linear``
  exactly.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.layers import linear as linear_mod
from specserve.layers import quant_tiles
from specserve.layers.quant_tiles import TileConfig, bf16_gemm_config
from tests.rounding import assert_rounded_from, fp64_linear, linear_case

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":  # before anything imports triton: its jit functions read TRITON_INTERPRET when defined
    os.environ["TRITON_INTERPRET"] = "1"

PTR = TileConfig(block_n=32, block_k=32, num_warps=4, num_stages=2, block_m=16, group_m=2)
TMA = TileConfig(block_n=32, block_k=32, num_warps=4, num_stages=2, block_m=16, group_m=2, tma=True)
SK_PTR = TileConfig(block_n=32, block_k=16, num_warps=4, num_stages=2, block_m=16, stream_k=True)
SK_TMA = TileConfig(block_n=32, block_k=16, num_warps=4, num_stages=2, block_m=16, tma=True, stream_k=True)


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


@pytest.mark.parametrize("cfg", [SK_PTR, SK_TMA], ids=["pointers", "tma"])
@pytest.mark.parametrize("programs", [3, 7, 40, 1000])
def test_streamk_equals_fp64_reference(gemm, cfg: TileConfig, programs: int) -> None:
    """M = 50 (4 row tiles of 16, the last ragged), N = 70 (3 column tiles, the last ragged), K = 72 (5 K steps of 16,
    the last ragged): 12 tiles, 60 iterations. 3 programs: 20 iterations each, tiles shared by two; 7: 8-9 each,
    some ranges inside one tile; 40: 1-2 each, tiles shared by up to 5; 1000: capped at 60, one iteration each.
    Repeats give the same bits and the counters are zero again after every launch."""
    x, w, b = _case(50, 70, 72, torch.bfloat16, True, seed=programs)
    counters = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    out = gemm.gemm_linear(x, w, b, config=cfg, counters=counters, programs=programs)
    assert out.dtype == torch.bfloat16 and out.shape == (50, 70)
    assert_rounded_from(out, fp64_linear(x, w, b))
    assert not counters.any()
    assert torch.equal(gemm.gemm_linear(x, w, b, config=cfg, counters=counters, programs=programs), out)
    assert not counters.any()


def test_streamk_float_out_and_small_counter_buffer(gemm) -> None:
    """LM-head style fp32 output through stream-K; a counter buffer with fewer entries than tiles is not used (the
    launch makes its own) and stays as it was."""
    x, w, _ = _case(33, 40, 64, torch.bfloat16, False, seed=9)
    small = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = gemm.gemm_linear(x, w, config=SK_PTR, out_dtype=torch.float32, counters=small, programs=5)
    assert out.dtype == torch.float32
    assert_rounded_from(out, fp64_linear(x, w, None))
    assert not small.any()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 40), n=st.integers(1, 80), k=st.integers(1, 70), programs=st.integers(1, 30),
       block_m=st.sampled_from([16, 32]), block_n=st.sampled_from([16, 32]), tma=st.booleans())
def test_streamk_property(gemm, m: int, n: int, k: int, programs: int, block_m: int, block_n: int,
                          tma: bool) -> None:
    """Any shape, tile and program count: the fp64 bound, and the counters left zeroed."""
    cfg = TileConfig(block_n=block_n, block_k=16, num_warps=4, num_stages=2, block_m=block_m, tma=tma, stream_k=True)
    x, w, b = _case(m, n, k, torch.float16, True, seed=m * 7 + n * 3 + k)
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    out = gemm.gemm_linear(x, w, b, config=cfg, counters=counters, programs=programs)
    assert_rounded_from(out, fp64_linear(x, w, b))
    assert not counters.any()


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


SWIGLU = TileConfig(block_n=16, block_k=16, num_warps=4, num_stages=2, block_m=16, stream_k=True)


def _exact_case(m: int, inter: int, k: int, seed: int):
    """Operands whose products and sums are exact in fp32 (small integers times 1/8), so the GEMM's sums do not
    depend on their order and the fused kernel must reproduce the two-kernel path bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (m, k), generator=gen).to(torch.bfloat16)
    w = (torch.randint(-2, 3, (2 * inter, k), generator=gen) * 0.125).to(torch.bfloat16)
    return x.to(DEVICE), w.to(DEVICE)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("programs", [3, 13])
def test_gemm_swiglu_is_silu_and_mul_of_the_projection(gemm, tma: bool, programs: int) -> None:
    """Exact sums: ``gemm_swiglu`` == ``silu_and_mul`` (torch's) of the rounded projection, bit for bit, for M = 50
    (ragged row tile), intermediate 35 (ragged column tile: the gate tile's tail reads up rows, never stored),
    K = 72 (ragged K step), with tiles shared between programs; the counters are left zeroed."""
    from specserve.layers.ops import TorchOps
    cfg = dataclasses.replace(SWIGLU, tma=tma)
    x, w = _exact_case(50, 35, 72, seed=programs)
    counters = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    out = gemm.gemm_swiglu(x, w, cfg, counters=counters, programs=programs)
    assert out.shape == (50, 35) and out.dtype == torch.bfloat16
    assert torch.equal(out.cpu(), TorchOps.silu_and_mul((x.double() @ w.double().t()).to(torch.bfloat16)).cpu())
    assert not counters.any()


def test_gemm_swiglu_random_operands_close_to_fp64(gemm) -> None:
    """Random operands: within bf16 rounding of silu(g) * u computed in fp64 (each of g, u and silu(g) rounded once
    to bf16, 2^-8 relative each, and the output once more)."""
    x, w, _ = _case(20, 80, 64, torch.bfloat16, False, seed=11)
    out = gemm.gemm_swiglu(x, w, SWIGLU, programs=6).double().cpu()
    gu = (x.double() @ w.double().t()).cpu()
    g, u = gu[:, :40], gu[:, 40:]
    ref = torch.nn.functional.silu(g) * u
    bound = 2.0 ** -8 * 4 * (g.abs() * 1.1 * u.abs() + ref.abs()) + 1e-6
    assert bool(((out - ref).abs() <= bound).all())


def test_gemm_swiglu_rejects_bad_operands(gemm) -> None:
    x, w = _exact_case(4, 8, 32, seed=0)
    with pytest.raises(ValueError, match="stream-K"):
        gemm.gemm_swiglu(x, w, dataclasses.replace(SWIGLU, stream_k=False))
    with pytest.raises(ValueError, match="even number of rows"):
        gemm.gemm_swiglu(x, w[:15], SWIGLU)
    assert gemm.gemm_swiglu(x[:0], w, SWIGLU).shape == (0, 8)


def test_mlp_takes_the_fused_swiglu_for_listed_rows(gemm, monkeypatch) -> None:
    """``MLP.forward`` with a ``BF16_SWIGLU_TILES`` entry for its gate_up shape: rows in the bucket go through
    ``gemm_swiglu`` (exact sums: the same bits as the unfused path), other rows and an empty table keep the
    projection + silu_and_mul."""
    from specserve.models.llama import MLP
    monkeypatch.setattr(linear_mod, "GEMV_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(quant_tiles, "BF16_GEMV_MAX_ROWS", 0)
    monkeypatch.setattr(quant_tiles, "BF16_GEMM_MIN_ROWS", 8)
    calls: list = []
    real = gemm.gemm_swiglu
    monkeypatch.setattr(gemm, "gemm_swiglu", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    config = type("C", (), {"hidden_size": 32, "intermediate_size": 24})()
    mlp = MLP(config).to(torch.bfloat16).to(DEVICE)
    x_all, w_up = _exact_case(20, 24, 32, seed=4)
    w_down = (torch.randint(-2, 3, (32, 24), generator=torch.Generator().manual_seed(5)) * 0.125).to(torch.bfloat16)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(w_up)
        mlp.down_proj.weight.copy_(w_down.to(DEVICE))
        expected = {m: mlp.down_proj(mlp.ops.silu_and_mul(mlp.gate_up_proj(x_all[:m]))) for m in (8, 9, 16, 17)}
        monkeypatch.setattr(quant_tiles, "BF16_SWIGLU_TILES", {(48, 32): {16: SWIGLU}})
        for m in (8, 9, 16, 17):
            assert torch.equal(mlp(x_all[:m]), expected[m])
    assert calls == [9, 16]
