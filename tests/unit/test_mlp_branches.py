"""The MLP split into branches over slices of its intermediate dimension (layers/mlp_branches.py) computes the same
function as the plain MLP: the interleaved layout, the one-GEMM path of small steps and the branch path of large
ones, on CPU (slices one after another; the GPU's streams only reorder the same launches)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.layers.mlp_branches import MlpBranches, interleave_gate_up, silu_and_mul_sliced
from specserve.layers.ops import TorchOps
from specserve.sampling import SamplingParams
from tests.tiny import prompts, tiny_config, tiny_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def plain_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return TorchOps.silu_and_mul(x @ gate_up.t()) @ down.t()


def test_interleave_worked_example() -> None:
    # inter = 4, C = 2: gate rows g0..g3 (0-3), up rows u0..u3 (10-13) -> [g0, g1, u0, u1, g2, g3, u2, u3]
    weight = torch.tensor([0., 1, 2, 3, 10, 11, 12, 13]).unsqueeze(1)
    assert interleave_gate_up(weight, 2).squeeze(1).tolist() == [0, 1, 10, 11, 2, 3, 12, 13]
    assert torch.equal(interleave_gate_up(weight, 1), weight)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), hidden=st.integers(1, 12), width=st.integers(1, 6), slices=st.sampled_from([1, 2, 3, 4]),
       seed=st.integers(0, 2**31 - 1))
def test_sliced_paths_equal_the_plain_mlp(rows: int, hidden: int, width: int, slices: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    inter = width * slices
    x = torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(2 * inter, hidden, generator=gen, dtype=torch.float64)
    down = torch.randn(hidden, inter, generator=gen, dtype=torch.float64)
    want = plain_mlp(x, gate_up, down)
    mixed = interleave_gate_up(gate_up, slices)
    one_gemm = silu_and_mul_sliced(TorchOps(), x @ mixed.t(), slices) @ down.t()
    torch.testing.assert_close(one_gemm, want, rtol=0, atol=1e-12)
    branches = MlpBranches(mixed, down, slices, side_streams=[])(TorchOps(), x)
    assert branches.dtype == x.dtype and branches.shape == want.shape
    torch.testing.assert_close(branches, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("min_rows", [1, 4, 1 << 30])
def test_split_model_keeps_its_logits(min_rows: int) -> None:
    """A tiny model's logits over a packed batch, before and after splitting every MLP (both paths cross
    ``min_rows``: a 3-row and a 7-row forward)."""
    engine = tiny_engine()
    model = engine.runner.model
    ids = [torch.tensor(p) for p in prompts([3, 7], seed=3)]
    before = [model_logits(model, i) for i in ids]
    assert model.split_mlps(2, min_rows, num_streams=2, device=torch.device("cpu")) == len(model.layers)
    assert model.split_mlps(2, min_rows, num_streams=2, device=torch.device("cpu")) == 0  # already split
    for i, want in zip(ids, before):
        torch.testing.assert_close(model_logits(model, i), want, rtol=1e-5, atol=1e-5)


def model_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[len(ids), vocab]: one sequence's prefill, eagerly, into a fresh paged cache (the MLPs see len(ids) rows)."""
    from specserve.layers.attention import TorchAttentionBackend, build_attention_metadata
    num, block = ids.shape[0], 4
    blocks = -(-num // block)
    caches = [(torch.zeros(blocks, block, model.config.num_key_value_heads, model.config.head_dim),
               torch.zeros(blocks, block, model.config.num_key_value_heads, model.config.head_dim))
              for _ in model.layers]
    meta = build_attention_metadata([num], [num], [list(range(blocks))], block, torch.device("cpu"))
    backend = TorchAttentionBackend()
    backend.prepare(meta, block)
    with torch.inference_mode():
        hidden, _ = model(ids, torch.arange(num), caches, meta, backend)
        return model.compute_logits(hidden)


def test_split_engine_generates_the_same_greedy_text() -> None:
    ps = prompts([5, 9, 2, 13], seed=4)
    want = [r.output_ids for r in tiny_engine().generate(ps, GREEDY)]
    engine = tiny_engine()
    assert engine.runner.model.split_mlps(4, 3, num_streams=2, device=torch.device("cpu")) == 2
    assert [r.output_ids for r in engine.generate(ps, GREEDY)] == want


def test_quantized_or_uneven_mlps_are_left_alone() -> None:
    engine = tiny_engine(quantization="int4")
    assert engine.runner.model.split_mlps(2, 1, 1, torch.device("cpu")) == 0
    model = tiny_engine().runner.model
    assert tiny_config().intermediate_size % 3 != 0
    assert model.split_mlps(3, 1, 1, torch.device("cpu")) == 0
    assert all(layer.mlp.branches is None for layer in model.layers)
