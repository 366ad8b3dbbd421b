"""Load a Hugging Face checkpoint directory (config.json + safetensors) into ``(ModelConfig, state_dict,
Tokenizer)``.

Reads ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``; supports the
LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM architectures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from specserve.config import ModelConfig
from specserve.tokenizer import Tokenizer

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def config_from_hf(hf: dict[str, Any], name: str = "model") -> ModelConfig:
    """Map a transformers ``config.json`` dict onto ``ModelConfig``."""
    archs = hf.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architectures {archs!r} (supported: {', '.join(HF_ARCHITECTURES)})")
    eos = hf.get("eos_token_id")
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    rope_params = hf.get("rope_parameters") or {}  # transformers >= 5 folds rope_theta/scaling in here
    rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    rope_scaling = hf.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    heads = int(hf["num_attention_heads"])
    return ModelConfig(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=hf.get("head_dim"),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=name,
    )


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32
                ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Load ``config.json``, the safetensors weights (floating-point ones cast to ``dtype``; integer ones, e.g. an
    AWQ checkpoint's packed 4-bit weights, as stored) and the tokenizer of ``path``."""
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    tokenizer = Tokenizer.from_hf_dir(path)
    config = config_from_hf(hf, name=hf.get("_name_or_path") or path.name)
    if not config.eos_token_ids:
        config.eos_token_ids = list(tokenizer.eos_token_ids)
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
    state_dict: dict[str, torch.Tensor] = {}
    for shard in _shard_files(path):
        for name, tensor in load_file(str(shard)).items():
            state_dict[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor  # AWQ's packed int32
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)  # the engine ties it to model.embed_tokens.weight
    return config, state_dict, tokenizer
