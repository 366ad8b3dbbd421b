"""The measured cuBLASLt configurations (quant_tiles.BF16_LT_ALGOS, layers/cublaslt_gemm.py): which row counts and
layers they serve, and that a layer without one (every CPU run) keeps its own path. The GEMMs themselves run on
the GPU only: benchmarks/cublaslt_algos_gpu.py compares each configuration's output with torch's, and
benchmarks/gpu_engine.py the verify logits with and without them."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from specserve.layers import quant_tiles
from specserve.layers.cublaslt_gemm import CONFIG_FIELDS, LtGemm, attach, entry_for, served_layers
from specserve.models.llama import LlamaForCausalLM
from specserve.models.shapes import shape_config

ENTRIES = [(0, 8, {"tile_id": 1}), (192, 256, {"tile_id": 2})]


@given(m=st.integers(-4, 600))
def test_entry_serves_exactly_its_row_range(m: int) -> None:
    want = {"tile_id": 1} if 0 < m <= 8 else {"tile_id": 2} if 192 < m <= 256 else None
    assert entry_for(ENTRIES, m) == want


def test_table_entries_are_well_formed() -> None:
    for (n, k), entries in quant_tiles.BF16_LT_ALGOS.items():
        assert n > 0 and k > 0
        ranges = sorted((lo, hi) for lo, hi, _ in entries)
        assert all(lo < hi for lo, hi in ranges)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), "overlapping row ranges"
        for _, _, cfg in entries:
            assert "id" in cfg and set(cfg) - {"id"} <= set(CONFIG_FIELDS)


def meta_llama8b() -> tuple:
    """The Llama-3.1-8B shape in bf16 on the meta device (no memory) -> (config, model)."""
    config = shape_config("llama-3.1-8b")
    with torch.device("meta"):
        return config, LlamaForCausalLM(config, 128).to(torch.bfloat16)


def test_table_serves_the_llama8b_projections_it_was_measured_on() -> None:
    """Built on the meta device (no memory): the table's shapes are Llama-3.1-8B's qkv, o, gate|up and down, all
    32 layers of each; the embedding and LM head are not served."""
    config, model = meta_llama8b()
    layers = served_layers(model, quant_tiles.BF16_LT_ALGOS)
    assert len(layers) == 4 * config.num_hidden_layers
    projections = {id(p) for layer in model.layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                              layer.mlp.gate_up_proj, layer.mlp.down_proj)}
    assert {id(m) for m in layers} == projections
    assert not served_layers(model.float(), quant_tiles.BF16_LT_ALGOS)  # fp32 weights: no 16-bit configuration


def test_cpu_models_get_no_configuration_and_keep_their_outputs() -> None:
    from tests.tiny import tiny_engine
    engine = tiny_engine()
    model = engine.runner.model
    assert engine.cublaslt_layers == 0
    n, k = model.layers[0].mlp.down_proj.weight.shape
    assert attach(model, {(n, k): [(0, 1 << 20, {"id": 66})]}, torch.device("cpu")) == 0
    assert all(getattr(m, "lt", None) is None for m in model.modules())


def test_cuda_without_bindings_warns_and_keeps_torch_calls(monkeypatch, caplog) -> None:
    """On by default: a CUDA engine without nvmath-python says so (how many projections keep torch's call) instead
    of silently running without the configurations. The model lives on the meta device; no GPU is touched."""
    from specserve.layers import cublaslt_gemm
    config, model = meta_llama8b()
    monkeypatch.setattr(cublaslt_gemm, "bindings", lambda: None)
    with caplog.at_level("WARNING", logger=cublaslt_gemm.__name__):
        assert attach(model, quant_tiles.BF16_LT_ALGOS, torch.device("cuda", 0)) == 0
    assert "nvmath-python is not installed" in caplog.text
    assert f"{4 * config.num_hidden_layers} projections" in caplog.text
    assert all(getattr(m, "lt", None) is None for m in model.modules())


class FakeGemm(LtGemm):
    """``LtGemm.vet``'s logic without cuBLASLt: entries whose config says ``"wrong"`` give a perturbed product,
    ``"rejected"`` none (as a configuration cuBLASLt refuses), others torch's own."""

    def __init__(self, k: int, entries: list) -> None:  # noqa: D107 - no context, no descriptors
        self.k, self.dtype, self.entries, self.plans = k, torch.float32, entries, {}

    def __call__(self, x, w):
        cfg = self.config_for(x.shape[0])
        if cfg is None or cfg.get("rejected"):
            return None
        out = torch.nn.functional.linear(x, w)
        return out + 0.1 * out.abs().max() if cfg.get("wrong") else out


def test_vet_keeps_agreeing_configurations_and_drops_wrong_ones() -> None:
    w = torch.randn(6, 5)
    good, wrong, refused = {"id": 1}, {"id": 2, "wrong": True}, {"id": 3, "rejected": True}
    gemm = FakeGemm(5, [(0, 4, good), (4, 8, wrong), (8, 12, refused)])
    assert gemm.vet(w)
    assert [cfg for _, _, cfg in gemm.entries] == [good, refused]
    assert not FakeGemm(5, [(4, 8, wrong)]).vet(w)  # nothing left to serve
    assert not FakeGemm(5, [(8, 12, refused)]).vet(w)
