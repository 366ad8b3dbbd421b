"""The Triton 16-bit-weight GEMV (layers/triton_gemv.py) and its opt-in routing (layers/linear.dense_linear,
``quant_tiles.BF16_GEMV_MAX_ROWS``). Without a GPU the kernel runs under Triton's interpreter
(tests/triton_interpreter.py), so the shapes stay small.

- ``gemv_linear`` == ``x @ W.T (+ bias)`` in fp64 up to fp32 summation order and one rounding to the 16-bit
  dtype, for M in {1, 2, 3, 4} (and 5: two row tiles), odd N (ragged last N tile), K not a multiple of BLOCK_K,
  bias or none, bf16 and fp16, split K off / forced / auto (in-launch reduction; counters left zero;
  deterministic).
- Routing: with ``BF16_GEMV_MAX_ROWS = 0`` ``Linear`` and ``dense_linear`` return exactly ``F.linear``'s result
  and never call the kernel; with it set, rows ``0 < M <= max`` of 16-bit weights of at least
  ``BF16_GEMV_MIN_WEIGHT`` elements go to the kernel and the rest (more rows, smaller, fp32 or non-contiguous
  weights) to ``F.linear``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from specserve.layers import linear as linear_mod
from specserve.layers import quant_tiles
from specserve.layers.quant_tiles import BF16_GEMV_TILES, TileConfig, override
from tests.rounding import assert_rounded_from, fp64_linear, linear_case

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":  # before anything imports triton: its jit functions read TRITON_INTERPRET when defined
    os.environ["TRITON_INTERPRET"] = "1"

CFG = TileConfig(block_n=16, block_k=32, num_warps=4, num_stages=1, use_dot=False)


@pytest.fixture(scope="module")
def gemv():
    """triton_gemv: compiled on a GPU, interpreted (with the interpreter patches) on CPU."""
    pytest.importorskip("triton")
    from specserve.layers import triton_gemv, triton_splitk
    if DEVICE.type == "cpu":
        from tests.triton_interpreter import fix_interpreter, reload_interpreted_chain
        fix_interpreter()
        _, triton_gemv = reload_interpreted_chain((triton_splitk, "splitk_reduce"), (triton_gemv, "_gemv_kernel"))
    return triton_gemv


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    return linear_case(m, n, k, dtype, bias, seed, DEVICE)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype, bias", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True),
                                         (torch.float16, False)])
def test_gemv_equals_fp64_reference(gemv, m: int, dtype: torch.dtype, bias: bool) -> None:
    """N = 37: a ragged last tile of 16; K = 80: two full K tiles of 32 and a ragged one (EVEN_K off); K = 96 with
    EVEN_K on; split K off (1) and forced (2: 48 + 32 of K = 80)."""
    for k in (80, 96):
        x, w, b = _case(m, 37, k, dtype, bias, seed=m + k)
        ref = fp64_linear(x, w, b)
        for split in (1, 2):
            out = gemv.gemv_linear(x, w, b, config=TileConfig(16, 32, 4, 1, split_k=split, use_dot=False))
            assert out.dtype == dtype and out.shape == (m, 37)
            assert_rounded_from(out, ref)


def test_gemv_split_k_auto_is_deterministic_and_leaves_counters_zero(gemv) -> None:
    """Auto split (4 "SMs" on CPU, 2 output tiles): several splits, reduced in the launch in split order, so
    repeated calls give the same bits and the shared counter buffer is zero afterwards."""
    from specserve.layers.triton_splitk import split_counters, split_plan
    x, w, b = _case(3, 24, 256, torch.bfloat16, True, seed=7)
    cfg = TileConfig(16, 32, 4, 1, split_k=0, use_dot=False)
    split, _ = split_plan(cfg, 256, 32, 2, x.device)
    assert split > 1
    counters = split_counters(24, x.device)
    first = gemv.gemv_linear(x, w, b, config=cfg, counters=counters)
    assert torch.count_nonzero(counters).item() == 0
    second = gemv.gemv_linear(x, w, b, config=cfg, counters=counters)
    assert torch.equal(first, second)
    assert_rounded_from(first, fp64_linear(x, w, b))


def test_gemv_table_lookup_and_strided_x(gemv) -> None:
    """The default configuration comes from ``BF16_GEMV_TILES`` (an override applies to the next call); x may be a
    strided view (a column slice of a wider tensor)."""
    wide, w, b = _case(2, 19, 130, torch.bfloat16, True, seed=3)
    x = wide[:, 1:129]  # [2, 128], row stride 130
    w = w[:, :128].contiguous()
    with override(BF16_GEMV_TILES, {4: CFG}):
        out = gemv.gemv_linear(x, w, b)
    assert_rounded_from(out, fp64_linear(x, w, b))


def test_gemv_rejects_mismatched_operands(gemv) -> None:
    x, w, _ = _case(1, 8, 32, torch.bfloat16, False)
    with pytest.raises(ValueError):
        gemv.gemv_linear(x.float(), w)
    with pytest.raises(ValueError):
        gemv.gemv_linear(x[:, :16], w)
    assert gemv.gemv_linear(x[:0], w).shape == (0, 8)


# ---- routing ----------------------------------------------------------------------------------------------------
def _layer(dtype: torch.dtype, bias: bool, n: int = 21, k: int = 64) -> linear_mod.Linear:
    torch.manual_seed(0)
    layer = linear_mod.Linear(k, n, bias=bias).to(dtype).to(DEVICE)
    return layer


def _count_calls(monkeypatch, gemv) -> list:
    calls: list = []
    real = gemv.gemv_linear

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(gemv, "gemv_linear", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_routing_off_is_exactly_f_linear(gemv, monkeypatch, dtype: torch.dtype) -> None:
    monkeypatch.setattr(quant_tiles, "BF16_GEMV_MAX_ROWS", 0)
    monkeypatch.setattr(quant_tiles, "BF16_GEMV_MIN_WEIGHT", 0)
    monkeypatch.setattr(linear_mod, "GEMV_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    calls = _count_calls(monkeypatch, gemv)
    layer = _layer(dtype, bias=True)
    for m in (1, 3, 4):
        x = torch.randn(m, 64, device=DEVICE).to(dtype)
        with torch.no_grad():
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
            assert torch.equal(linear_mod.dense_linear(x, layer.weight), F.linear(x, layer.weight))
    assert calls == []


@pytest.mark.parametrize("dtype, bias", [(torch.bfloat16, True), (torch.float16, False)])
def test_routing_honours_max_rows(gemv, monkeypatch, dtype: torch.dtype, bias: bool) -> None:
    """``BF16_GEMV_MAX_ROWS = 3`` (read at call time): 1 to 3 rows of a 16-bit layer go to the kernel (its fp64
    bound holds), 4 rows, fp32 weights and non-contiguous weights to F.linear (bit for bit)."""
    monkeypatch.setattr(linear_mod, "GEMV_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(quant_tiles, "BF16_GEMV_MAX_ROWS", 3)
    monkeypatch.setattr(quant_tiles, "BF16_GEMV_MIN_WEIGHT", 21 * 64)  # the layer's [21, 64] weight: just enough
    calls = _count_calls(monkeypatch, gemv)
    layer = _layer(dtype, bias)
    with torch.no_grad(), override(BF16_GEMV_TILES, {4: CFG}):
        for m in (1, 2, 3, 4):
            x = torch.randn(m, 64, device=DEVICE).to(dtype)
            out = layer(x)
            if m <= 3:
                assert_rounded_from(out, fp64_linear(x, layer.weight, layer.bias))
            else:
                assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
        assert calls == [1, 2, 3]
        x = torch.randn(2, 64, device=DEVICE)
        fp32 = _layer(torch.float32, bias)
        assert torch.equal(fp32(x), F.linear(x, fp32.weight, fp32.bias))
        w_t = torch.randn(64, 21, device=DEVICE).to(dtype).t()  # [21, 64], not contiguous
        assert torch.equal(linear_mod.dense_linear(x.to(dtype), w_t), F.linear(x.to(dtype), w_t))
        small = torch.randn(20, 64, device=DEVICE).to(dtype)  # fits the kernel, one row short of the minimum
        assert torch.equal(linear_mod.dense_linear(x.to(dtype), small), F.linear(x.to(dtype), small))
        assert calls == [1, 2, 3]
        head = torch.randn(50, 64, device=DEVICE).to(dtype)  # an LM head / embedding weight [vocab, hidden]
        out = linear_mod.dense_linear(x.to(dtype), head)
        assert calls == [1, 2, 3, 2]
        assert_rounded_from(out, fp64_linear(x.to(dtype), head, None))


def test_compute_logits_routes_through_dense_linear(monkeypatch) -> None:
    """The LM head's 16-bit path is ``dense_linear`` (so ``BF16_GEMV_MAX_ROWS`` covers it too)."""
    from specserve.models import llama
    seen: list = []
    monkeypatch.setattr(llama, "dense_linear",
                        lambda x, w, b=None, float_out=False: seen.append((w, float_out)) or F.linear(x, w, b).float())
    model = llama.LlamaForCausalLM.__new__(llama.LlamaForCausalLM)
    torch.nn.Module.__init__(model)
    model._quant_head, model._packed_head, model.lm_head, model.quantized_head = None, None, None, None
    model.embed_tokens = torch.nn.Embedding(10, 8)
    logits = model.compute_logits(torch.randn(2, 8))
    assert logits.shape == (2, 10) and logits.dtype == torch.float32
    assert seen[0][0] is model.embed_tokens.weight and seen[0][1]  # the head asks for float32 logits


@pytest.mark.parametrize("m", [1, 3])
def test_float_out_skips_the_16_bit_rounding(gemv, monkeypatch, m: int) -> None:
    """``dense_linear(float_out=True)`` (the LM head): through the GEMV the fp32 sums come back unrounded (the fp64
    bound at fp32's half ulp, which the bf16 result misses); off the GEMV's rows ``F.linear(...).float()`` exactly
    on CPU (on CUDA cuBLAS writes fp32 itself)."""
    monkeypatch.setattr(linear_mod, "GEMV_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(quant_tiles, "BF16_GEMV_MAX_ROWS", 1)
    monkeypatch.setattr(quant_tiles, "BF16_GEMV_MIN_WEIGHT", 0)
    x, w, _ = _case(m, 37, 96, torch.bfloat16, False, seed=11)
    with override(BF16_GEMV_TILES, {4: CFG}):
        out = linear_mod.dense_linear(x, w, float_out=True)
        rounded = linear_mod.dense_linear(x, w)
    assert out.dtype == torch.float32 and out.shape == (m, 37)
    ref = fp64_linear(x, w, None)
    if m == 1:
        assert_rounded_from(out, ref)
        assert torch.equal(out.to(torch.bfloat16), rounded)  # the same sums, rounded once more
        assert not torch.equal(out, rounded.float())
    elif DEVICE.type == "cpu":
        assert torch.equal(out, F.linear(x, w).float())
    else:
        assert_rounded_from(out, ref, rtol=1e-4)
    f32 = torch.randn(m, 96, device=DEVICE)
    assert torch.equal(linear_mod.dense_linear(f32, w.float(), float_out=True), F.linear(f32, w.float()))
