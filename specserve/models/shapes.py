"""Named model shapes for dummy (random-weight) loading: measure engine cost at real sizes whose weights
are not available offline. Numbers are the published configs of each model."""

from __future__ import annotations

from specserve.config import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

MODEL_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-3.2-1b": dict(architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, max_position_embeddings=131072,
                         tie_word_embeddings=True, head_dim=64),
    "llama-3.1-8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072),
    "llama-3.3-70b": dict(architecture="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0,
                          rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072),
    "qwen2.5-7b": dict(architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0,
                       max_position_embeddings=32768, attention_bias=True, rms_norm_eps=1e-6),
    "qwen3-8b": dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1000000.0, max_position_embeddings=40960, qk_norm=True, rms_norm_eps=1e-6),
}


def shape_config(name: str) -> ModelConfig:
    if name not in MODEL_SHAPES:
        raise ValueError(f"model_shape: unknown shape {name!r}; known: {', '.join(sorted(MODEL_SHAPES))}")
    return ModelConfig(name=f"dummy-{name}", **MODEL_SHAPES[name])
