"""Rotary frequencies equal transformers' for the plain, linear and Llama 3 schedules."""

from __future__ import annotations

import pytest
import torch

from specserve.layers.rope import rope_inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3,
                                     {**LLAMA3, "factor": 32.0}])
def test_inv_freq_matches_transformers(scaling) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, head_dim = 500000.0, 128
    params = {"rope_theta": theta, "rope_type": "default", **(scaling or {})}
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=params,
                                      max_position_embeddings=131072)
    if scaling is None:
        want = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, torch.device("cpu"))
    torch.testing.assert_close(rope_inv_freq(head_dim, theta, scaling), want.float(), rtol=1e-6, atol=0)


def test_unknown_rope_type_names_the_field() -> None:
    with pytest.raises(ValueError, match="rope_scaling"):
        rope_inv_freq(64, 10000.0, {"rope_type": "nope"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_is_one_gather_of_the_tables_in_the_model_dtype(dtype) -> None:
    from specserve.layers.rope import RotaryEmbedding

    head_dim, theta = 64, 10000.0
    positions = torch.tensor([0, 5, 99, 5, 31])
    rope = RotaryEmbedding(head_dim, 100, theta, None, torch.device("cpu"), dtype)
    assert rope.cos_sin_cached.dtype == dtype
    cos, sin = rope.cos_sin(positions, dtype)
    assert cos.shape == sin.shape == (5, 1, head_dim) and cos.dtype == sin.dtype == dtype
    assert cos.stride(-1) == 1 and cos.stride(0) == 2 * head_dim  # views into the one gathered [5, 2, 64]
    freqs = torch.outer(positions.float(), rope_inv_freq(head_dim, theta, None))
    emb = torch.cat([freqs, freqs], dim=-1)
    assert torch.equal(cos.squeeze(1), emb.cos().to(dtype)) and torch.equal(sin.squeeze(1), emb.sin().to(dtype))
    fp32 = RotaryEmbedding(head_dim, 100, theta, None, torch.device("cpu"))  # fp32 tables, cast on lookup
    assert all(torch.equal(a, b) for a, b in zip(fp32.cos_sin(positions, dtype), (cos, sin)))
