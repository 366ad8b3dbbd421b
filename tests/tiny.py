"""Tiny seeded random models for fast CPU tests (no checkpoint, no tokenizer)."""

from __future__ import annotations

import torch

from specserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specserve.engine.engine import LLMEngine
from specserve.models.loader import _init_dummy, build_model


def tiny_config(architecture: str = "llama", **overrides) -> ModelConfig:
    base = dict(architecture=architecture, vocab_size=97, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_theta=10000.0, attention_bias=architecture == "qwen2", qk_norm=architecture == "qwen3",
                tie_word_embeddings=architecture != "qwen2")
    base.update(overrides)
    return ModelConfig(**base)


def shape_for_tests(model) -> None:
    """Random weights give near-uniform logits and, with large embeddings, a model that repeats one token.
    Strong MLPs make the greedy text vary, and a sharper final norm widens the gap between the top two logits
    (so greedy choices are not near-ties that float round-off between batch shapes could flip)."""
    with torch.no_grad():
        model.embed_tokens.weight.mul_(2.0)
        for layer in model.layers:
            layer.mlp.down_proj.weight.mul_(16.0)
        model.norm.weight.mul_(2.0)
    model.pack_weights()


def tiny_engine(architecture: str = "llama", seed: int = 0, num_blocks: int = 256, block_size: int = 4,
                max_num_batched_tokens: int = 512, max_num_seqs: int = 64, chunked: bool = True,
                max_model_len: int = 512, sampler_seed: int = 0, spec: SpecConfig | None = None,
                proposers: dict | None = None, quantization: str | None = None,
                quantize_lm_head: bool = False) -> LLMEngine:
    config = tiny_config(architecture)
    model = build_model(config, config.max_position_embeddings, torch.float32, torch.device("cpu"))
    _init_dummy(model, seed)
    shape_for_tests(model)
    if quantization is not None:
        from specserve.models.quantize import quantize_model
        quantize_model(model, quantization, lm_head=quantize_lm_head)
    engine_config = EngineConfig(
        model="tiny", seed=sampler_seed, cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  enable_chunked_prefill=chunked, max_model_len=max_model_len),
        speculative=spec or SpecConfig())
    return LLMEngine(engine_config, model, config, tokenizer=None, proposers=proposers)


def prompts(lengths: list[int], vocab: int = 97, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
