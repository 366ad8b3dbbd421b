"""FP8 and INT4 quantized projections (layers/quant_gpu.py, layers/triton_w4a16.py, models/quantize.py).

- INT4 packing round-trips; group-wise quantization error is within half a step of each group's grid.
- The Triton W4A16 GEMM == the torch reference dequant GEMM (fp32 and bf16 activations, M 1..64, ragged N
  tiles, split-K on and off). Without a GPU the kernel runs under Triton's interpreter. (The W8A16 kernel, the
  fused FP8 quantizer and W4A16's GEMV path: tests/unit/test_triton_quant.py.)
- FP8 e4m3 per-channel / per-token quantization error is within e4m3's rounding bound; ``torch._scaled_mm``
  (where this torch has it on CPU) computes the reference's maths.
- A tiny model quantized with int4 / fp8 gives logits close to the unquantized model's; the quantized engine's
  greedy output is deterministic and equals its own speculative (n-gram, draft=self) greedy output.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.config import EngineConfig, SpecConfig
from specserve.layers.quant_gpu import (
    FP8_DTYPE,
    Fp8Linear,
    Int4Linear,
    dequantize_fp8_rows,
    dequantize_int4,
    fp8_linear_reference,
    fp8_linear_scaled_mm,
    int4_group_size_for,
    int4_linear_reference,
    pack_int4,
    quantize_fp8_rows,
    quantize_int4,
    unpack_int4,
)
from specserve.models.quantize import quantize_model
from specserve.sampling import SamplingParams
from tests.tiny import prompts, tiny_engine

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":  # before anything imports triton: its jit functions read TRITON_INTERPRET when defined
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def w4a16():
    """The kernel module: compiled on a GPU, interpreted (with the interpreter patches) on CPU."""
    pytest.importorskip("triton")
    from specserve.layers import triton_splitk, triton_w4a16
    if DEVICE.type == "cpu":
        from tests.triton_interpreter import fix_interpreter, reload_interpreted_chain
        fix_interpreter()
        return reload_interpreted_chain((triton_splitk, "splitk_reduce"), (triton_w4a16, "_w4a16_kernel"))[1]
    return triton_w4a16


# ---- INT4 packing and quantization --------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(k8=st.integers(1, 6), n=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_int4_pack_unpack_round_trip(k8: int, n: int, seed: int) -> None:
    q = torch.randint(0, 16, (8 * k8, n), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (k8, n)
    assert torch.equal(unpack_int4(packed), q)


def test_int4_pack_layout() -> None:
    q = torch.arange(16, dtype=torch.uint8).view(16, 1)  # k = 0..15 of one column
    assert pack_int4(q)[:, 0].tolist() == [0x76543210, 0xFEDCBA98 - 2**32]  # value k % 8 in bits 4 * (k % 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_quantization_error_is_half_a_step(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=gen).to(dtype)
    w[3, :128] = 0.0  # a constant group
    w[5, 128:] = torch.rand(128, generator=gen) + 1.0  # an all-positive group: 0 stays inside the range
    qweight, scales, zeros = quantize_int4(w, 128)
    assert qweight.shape == (32, 48) and scales.shape == zeros.shape == (2, 48) and scales.dtype == dtype
    assert zeros.min() >= 0 and zeros.max() <= 15 and torch.equal(zeros, zeros.round())
    err = (dequantize_int4(qweight, scales, zeros) - w.float()).abs()  # [48, 256]
    step = scales.float().t().repeat_interleave(128, dim=1)  # [48, 256]
    assert (err <= step / 2 * 1.01 + 1e-6).all()
    assert err[3, :128].max() == 0


def test_int4_group_size_falls_back_to_a_divisor() -> None:
    assert int4_group_size_for(4096) == 128 and int4_group_size_for(576) == 64 and int4_group_size_for(32) == 32
    with pytest.raises(ValueError, match="group_size"):
        int4_group_size_for(40)


# ---- Triton W4A16 GEMM vs the torch reference -----------------------------------------------------------------
def _int4_case(m: int, n: int, k: int, group_size: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    qweight, scales, zeros = (t.to(DEVICE) for t in quantize_int4(w, group_size, dtype))
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    return x, qweight, scales, zeros


def _assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:  # both round an fp32 sum to bf16: at most one or two bf16 steps apart
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_w4a16_kernel_matches_reference(w4a16, m: int, dtype: torch.dtype) -> None:
    # N = 96 leaves a ragged second N tile of 64; K = 384 is three groups of 128 (and an uneven split-K).
    x, qweight, scales, zeros = _int4_case(m, 96, 384, 128, dtype, seed=m)
    ref = int4_linear_reference(x, qweight, scales, zeros, None)
    _assert_close_to_reference(w4a16.w4a16_linear(x, qweight, scales, zeros), ref, dtype)


@pytest.mark.parametrize("split_k, block", [(1, None), (2, None), (5, (16, 32, 32)), (1, (32, 32, 64))])
def test_w4a16_kernel_tilings_and_splits(w4a16, split_k: int, block) -> None:
    x, qweight, scales, zeros = _int4_case(5, 80, 320, 64, torch.bfloat16, seed=split_k)  # groups of 64
    bias = torch.randn(80, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    ref = int4_linear_reference(x, qweight, scales, zeros, bias)
    out = w4a16.w4a16_linear(x, qweight, scales, zeros, bias, split_k=split_k, block=block)
    _assert_close_to_reference(out, ref, torch.bfloat16)


@pytest.mark.parametrize("m, split_k, block",
                         [(5, 1, None), (17, 2, None), (5, 5, (16, 32, 32)), (40, 1, (32, 32, 64))])
def test_w4a16_operands_ahead_change_no_bit(w4a16, monkeypatch, m: int, split_k: int, block) -> None:
    # Loading each K tile's activations, scales and zeros a loop step early (tiles of up to OPERANDS_AHEAD_MAX_ROWS
    # rows) is the same maths: equal bits to the in-step loads, over ragged splits (5 of 10 K tiles: the last
    # split's lookahead is masked), whatever the tile's rows.
    x, qweight, scales, zeros = _int4_case(m, 80, 320, 64, torch.bfloat16, seed=m)
    outs = []
    for limit in (0, 64):
        monkeypatch.setattr(w4a16, "OPERANDS_AHEAD_MAX_ROWS", limit)
        outs.append(w4a16.w4a16_linear(x, qweight, scales, zeros, split_k=split_k, block=block))
    assert torch.equal(outs[0], outs[1])
    _assert_close_to_reference(outs[1], int4_linear_reference(x, qweight, scales, zeros, None), torch.bfloat16)


def test_w4a16_kernel_strided_activations(w4a16) -> None:
    x, qweight, scales, zeros = _int4_case(7, 64, 128, 128, torch.float32)
    wide = torch.cat([x, torch.randn_like(x)], dim=1)[:, :128]  # row stride 256
    ref = int4_linear_reference(x, qweight, scales, zeros, None)
    _assert_close_to_reference(w4a16.w4a16_linear(wide, qweight, scales, zeros), ref, torch.float32)
    assert w4a16.w4a16_linear(x[:0], qweight, scales, zeros).shape == (0, 64)


def test_int4_linear_module_uses_the_kernel_when_asked(w4a16) -> None:
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(9, 64, generator=gen).to(DEVICE)
    kernel = Int4Linear.from_float(w, b, use_triton=True).to(DEVICE)
    reference = Int4Linear.from_float(w, b, use_triton=False).to(DEVICE)
    assert kernel.group_size == 64
    torch.testing.assert_close(kernel(x), reference(x), atol=1e-4, rtol=1e-4)


# ---- FP8 -----------------------------------------------------------------------------------------------------
def test_fp8_rowwise_quantization_error_bound() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=gen) * torch.logspace(-3, 3, 16).unsqueeze(1)  # rows of very different size
    x_q, scale = quantize_fp8_rows(x.to(torch.bfloat16))
    assert x_q.dtype == FP8_DTYPE and scale.shape == (16, 1)
    assert torch.allclose(x_q.float().abs().amax(dim=1), torch.full((16,), 448.0))  # each row uses the full range
    err = (dequantize_fp8_rows(x_q, scale) - x.to(torch.bfloat16).float()).abs()
    # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4 for normals; absolute 2^-10 * scale for subnormals
    assert (err <= x.abs() * 2**-4 * 1.01 + scale * 2**-9).all()


def test_fp8_linear_close_to_bf16() -> None:
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(96, 256, generator=gen) / 16).to(torch.bfloat16)
    x = torch.randn(11, 256, generator=gen).to(torch.bfloat16)
    layer = Fp8Linear.from_float(w, None)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (1, 96)
    out, ref = layer(x).float(), (x.float() @ w.float().t())
    assert ((out - ref).norm() / ref.norm()).item() < 0.05


def test_scaled_mm_computes_the_reference() -> None:
    """The arguments given to ``torch._scaled_mm`` (operand layout, row-wise scale shapes), checked on CPU where
    this torch implements it; on CUDA the same call runs the tensor-core kernel."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16)
    b = torch.randn(64, generator=gen).to(torch.bfloat16)
    layer = Fp8Linear.from_float(w, b)
    try:
        out = fp8_linear_scaled_mm(x, layer.weight, layer.weight_scale, layer.bias)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._scaled_mm with row-wise scales is not available here: {exc}")
    ref = fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.bias)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=1.6e-2)


# ---- whole models ----------------------------------------------------------------------------------------------
@torch.inference_mode()
def _logits(engine, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    hidden, _ = engine.runner.forward(ids, list(range(n)), [n], [n], [list(range(-(-n // 4)))])
    return engine.runner.model.compute_logits(hidden)  # [n, vocab]


def test_quantized_tiny_model_logits_close_to_unquantized() -> None:
    """Random Gaussian weights are the hard case (no outliers to protect, every value rounded): one e4m3 GEMM
    has ~5% relative error (weights and activations each ~2^-4 / sqrt(3) rms), one 4-bit GEMM ~10% (a step of
    ~1/3 sigma, sqrt(12) rms), compounded over 2 layers x 4 projections (measured: 0.14 and 0.35)."""
    ids = prompts([40])[0]
    ref = _logits(tiny_engine(), ids)  # [40, vocab]
    rel = {}
    for method in ("fp8", "int4"):
        out = _logits(tiny_engine(quantization=method), ids)
        rel[method] = ((out - ref).norm() / ref.norm()).item()
        assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.5
    assert 0 < rel["fp8"] < 0.2 and 0 < rel["int4"] < 0.45 and rel["fp8"] < rel["int4"]


def test_quantize_model_replaces_projections_only() -> None:
    engine = tiny_engine(quantization="int4")
    model = engine.runner.model
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and isinstance(layer.mlp.down_proj, Int4Linear)
    assert model.embed_tokens.weight.dtype == torch.float32 and model.quantization == "int4"
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(model, "int4")
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(model, "int3")


def test_tiny_model_forward_through_the_kernel(w4a16) -> None:
    """The whole quantized model with the Triton kernel (interpreted on CPU) == with the reference path."""
    if DEVICE.type != "cpu":  # the tiny engine is built on CPU: the compiled kernel cannot read its tensors
        pytest.skip("CPU-interpreter check; on a GPU the layer tests above and benchmarks/gpu_engine.py cover it")
    ids = prompts([9])[0]
    engine = tiny_engine(quantization="int4")
    ref = _logits(engine, ids)
    for module in engine.runner.model.modules():
        if isinstance(module, Int4Linear):
            module.use_triton = True
    torch.testing.assert_close(_logits(engine, ids), ref, atol=1e-3, rtol=1e-4)


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LENGTHS = [5, 17, 3, 40]


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_quantized_greedy_is_deterministic_and_speculation_is_lossless(method: str) -> None:
    ps = prompts(LENGTHS)
    plain = [r.output_ids for r in tiny_engine(quantization=method).generate(ps, GREEDY)]
    assert [r.output_ids for r in tiny_engine(quantization=method).generate(ps, GREEDY)] == plain
    unquantized = [r.output_ids for r in tiny_engine().generate(ps, GREEDY)]
    assert plain != unquantized or method == "fp8"  # 4-bit weights change some greedy choice
    for spec in (SpecConfig(method="ngram", num_spec_tokens=3), SpecConfig(method="draft", model="self",
                                                                          num_spec_tokens=3)):
        reqs = tiny_engine(quantization=method, spec=spec).generate(ps, GREEDY)
        assert [r.output_ids for r in reqs] == plain
        assert sum(r.spec_counters.num_drafts for r in reqs) > 0
        if spec.method == "draft":  # the draft is the quantized target itself
            assert all(r.spec_counters.acceptance_rate == 1.0 for r in reqs)


def test_quantization_config_and_flag() -> None:
    from specserve.cli import build_parser, engine_config_from_args
    with pytest.raises(ValueError, match="^quantization: "):
        EngineConfig(quantization="int8")
    args = build_parser().parse_args(["serve", "--load-format", "dummy", "--model-shape", "llama-3.3-70b",
                                      "--quantization", "int4"])
    cfg = engine_config_from_args(args)
    assert cfg.quantization == "int4" and cfg.model == "dummy:llama-3.3-70b"
    assert engine_config_from_args(build_parser().parse_args(["serve"])).quantization is None


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # tied / untied LM head
@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_quantized_lm_head_computes_the_quantized_maths(method: str, architecture: str) -> None:
    """``--quantize-lm-head``: the logits are the reference maths of the method on the 16-bit head's weights
    (per-channel e4m3 with per-token activations; int4 groups), the decoder layers are those of the default
    quantized model, a tied embedding table is left as it was, an untied bf16 head is freed, and speculation
    stays lossless against the quantized model."""
    base = tiny_engine(architecture, quantization=method)
    engine = tiny_engine(architecture, quantization=method, quantize_lm_head=True)
    model, ref_model = engine.runner.model, base.runner.model
    head_weight = ref_model.embed_tokens.weight if ref_model.lm_head is None else ref_model.lm_head.weight
    assert isinstance(model.quantized_head, Fp8Linear if method == "fp8" else Int4Linear)
    ids = prompts([23])[0]
    n = len(ids)
    hidden, _ = engine.runner.forward(ids, list(range(n)), [n], [n], [list(range(-(-n // 4)))])
    ref_hidden, _ = base.runner.forward(ids, list(range(n)), [n], [n], [list(range(-(-n // 4)))])
    torch.testing.assert_close(hidden, ref_hidden, rtol=0, atol=0)  # same decoder layers
    got = model.compute_logits(hidden)  # [n, vocab] float32
    if method == "fp8":
        w_q, w_scale = quantize_fp8_rows(head_weight)
        want = fp8_linear_reference(hidden, w_q, w_scale.reshape(1, -1), None).float()
    else:
        qweight, scales, zeros = quantize_int4(head_weight, int4_group_size_for(head_weight.shape[1]))
        want = int4_linear_reference(hidden, qweight, scales, zeros, None).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = ref_model.compute_logits(ref_hidden)
    rel = ((got - exact).norm() / exact.norm()).item()
    assert 0 < rel < (0.1 if method == "fp8" else 0.3)
    if architecture == "llama":  # tied: the table stays, in the model dtype, for the lookups
        assert model.lm_head is None
        torch.testing.assert_close(model.embed_tokens.weight, ref_model.embed_tokens.weight, rtol=0, atol=0)
    else:
        with pytest.raises(RuntimeError, match="quantized"):
            _ = model.lm_head.weight
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, method, lm_head=True)
    ps = prompts(LENGTHS)
    plain = [r.output_ids for r in engine.generate(ps, GREEDY)]
    spec = tiny_engine(architecture, quantization=method, quantize_lm_head=True,
                       spec=SpecConfig(method="ngram", num_spec_tokens=3)).generate(ps, GREEDY)
    assert [r.output_ids for r in spec] == plain and sum(r.spec_counters.num_drafts for r in spec) > 0


def test_quantize_lm_head_config_and_flag() -> None:
    from specserve.cli import build_parser, engine_config_from_args
    from specserve.models.loader import load_model
    with pytest.raises(ValueError, match="^quantize_lm_head: "):
        EngineConfig(quantize_lm_head=True)
    with pytest.raises(ValueError, match="^quantize_lm_head: "):
        load_model("dummy:smollm2-135m", "float32", torch.device("cpu"), 64, quantize_lm_head=True)
    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["serve", "--quantization", "fp8", "--quantize-lm-head"])).quantize_lm_head
    assert not engine_config_from_args(parse(["serve", "--quantization", "fp8"])).quantize_lm_head
    with pytest.raises(ValueError, match="^quantize_lm_head: "):
        engine_config_from_args(parse(["serve", "--quantize-lm-head"]))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_load_model_quantizes_a_dummy_checkpoint(method: str) -> None:
    from specserve.models.loader import load_model
    model, config, _ = load_model("dummy:smollm2-135m", "float32", torch.device("cpu"), 256, quantization=method)
    kinds = {type(m).__name__ for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj)}
    assert kinds == {"Fp8Linear" if method == "fp8" else "Int4Linear"}


@pytest.mark.slow
def test_quant_kernels_compile_for_sm90() -> None:
    """Lower every tile-table configuration of the W8A16 / W4A16 GEMMs and the FP8 quantizer for sm_90
    (tests/unit/quant_compile_check.py, bf16 on one shape): the interpreter never does."""
    import subprocess
    import sys
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": root}
    result = subprocess.run([sys.executable, os.path.join(root, "tests", "unit", "quant_compile_check.py"), "--quick",
                             "--no-usage"], env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def _awq_pack(q: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's packing loop (WQLinear_GEMM.from_linear), transcribed: nibble i of word c = column 8c + order[i]."""
    from specserve.models.quantize import AWQ_PACK_ORDER
    rows, n = q.shape
    packed = torch.zeros(rows, n // 8, dtype=torch.int64)
    for c in range(n // 8):
        for i, col in enumerate(AWQ_PACK_ORDER):
            packed[:, c] |= q[:, 8 * c + col].to(torch.int64) << (4 * i)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def test_awq_tensors_convert_to_our_layout() -> None:
    from specserve.models.quantize import awq_to_int4
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(24, 256, generator=gen)  # [N, K]
    qweight, scales, zeros = quantize_int4(w, 128)
    q = unpack_int4(qweight)  # [K, N]
    awq_q, awq_z = _awq_pack(q), _awq_pack(zeros.to(torch.uint8))
    assert awq_q.shape == (256, 3) and awq_z.shape == (2, 3)
    got = awq_to_int4(awq_q, awq_z, scales)
    assert torch.equal(got[0], qweight) and torch.equal(got[1], scales) and torch.equal(got[2], zeros)
    layer = Int4Linear(*got, use_triton=False)
    x = torch.randn(3, 256, generator=gen)
    torch.testing.assert_close(layer(x), x @ dequantize_int4(qweight, scales, zeros).t())


def test_awq_checkpoint_state_loads_into_int4_layers() -> None:
    """A model whose AWQ-format state dict was made from an int4-quantized tiny model loads back into Int4Linear
    layers (q|k|v and gate|up fused again) and gives exactly that model's logits."""
    from specserve.models.loader import build_model
    from specserve.models.quantize import PROJECTIONS, awq_quant_config, load_awq_projections
    source = tiny_engine("qwen2", quantization="int4")  # qwen2: q/k/v biases too
    model, config = source.runner.model, source.model_config
    state = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
             "lm_head.weight": model.lm_head.weight}
    splits = {"qkv_proj": (["q_proj", "k_proj", "v_proj"], [config.num_attention_heads * config.head_dim,
                                                            config.num_key_value_heads * config.head_dim,
                                                            config.num_key_value_heads * config.head_dim]),
              "o_proj": (["o_proj"], None), "gate_up_proj": (["gate_proj", "up_proj"], [config.intermediate_size] * 2),
              "down_proj": (["down_proj"], None)}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        state |= {p + "input_layernorm.weight": layer.input_layernorm.weight,
                  p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight}
        for parent_name, name in PROJECTIONS:
            module = getattr(getattr(layer, parent_name), name)
            names, sizes = splits[name]
            sizes = sizes or [module.out_features]
            q_parts = unpack_int4(module.qweight).split(sizes, dim=1)
            s_parts, z_parts = module.scales.split(sizes, dim=1), module.zeros.split(sizes, dim=1)
            for part, q, s, z in zip(names, q_parts, s_parts, z_parts):
                key = f"{p}{parent_name}.{part}"
                state |= {key + ".qweight": _awq_pack(q), key + ".qzeros": _awq_pack(z.to(torch.uint8)),
                          key + ".scales": s}
            if module.bias is not None:
                for part, b in zip(names, module.bias.split(sizes)):
                    state[f"{p}{parent_name}.{part}.bias"] = b
    assert awq_quant_config({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemm"}})
    assert awq_quant_config({}) is None
    with pytest.raises(ValueError, match="quantization"):
        awq_quant_config({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}})
    loaded = build_model(config, config.max_position_embeddings, torch.float32, torch.device("cpu"))
    assert load_awq_projections(loaded, state, torch.float32) == 4 * config.num_hidden_layers
    loaded.load_hf_state_dict({k: v.detach() for k, v in state.items()})
    loaded.pack_weights()
    target = tiny_engine("qwen2")
    target.runner.model = loaded
    ids = prompts([12])[0]
    torch.testing.assert_close(_logits(target, ids), _logits(source, ids), atol=0, rtol=0)
