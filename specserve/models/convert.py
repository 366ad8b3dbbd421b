"""Convert a GGUF file into a Hugging Face checkpoint directory (dequantised weights).

Writes ``config.json`` (loadable by transformers and vLLM), ``model.safetensors`` (or shards plus
``model.safetensors.index.json``), ``tokenizer.json``, ``tokenizer_config.json`` and
``generation_config.json``. Quantised tensors are dequantised, so the output is bf16 or fp32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specserve.config import ModelConfig
from specserve.models.gguf_loader import load_gguf

_HF_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def hf_config_dict(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A transformers ``config.json`` for ``config``."""
    arch_class, model_type = _HF_ARCH[config.architecture]
    eos: int | list[int] | None = config.eos_token_ids or None
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    out: dict[str, Any] = {
        "architectures": [arch_class],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "dtype": _DTYPE_NAMES[dtype],
    }
    if config.architecture == "llama":
        out.update(mlp_bias=False, pretraining_tp=1)
    else:  # qwen2 / qwen3
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_hidden_layers)
    return out


def _shards(state_dict: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[list[str]]:
    """Group tensor names into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    names = sorted(state_dict)
    if max_shard_bytes is None:
        return [names]
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = state_dict[name].numel() * state_dict[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_state_dict(state_dict: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int | None) -> None:
    """Write ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards plus their index."""
    groups = _shards(state_dict, max_shard_bytes)
    if len(groups) == 1:
        save_file({n: state_dict[n].contiguous() for n in groups[0]}, str(out_dir / "model.safetensors"),
                  metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: state_dict[n].contiguous() for n in group}, str(out_dir / fname),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, max_shard_bytes: int | None = None,
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """Dequantise ``gguf_path`` into a Hugging Face checkpoint at ``out_dir`` (bf16 or fp32); returns it."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config, state_dict, tokenizer = load_gguf(gguf_path, dtype=dtype)
    _write_json(out_dir / "config.json", hf_config_dict(config, dtype))
    generation: dict[str, Any] = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids}
    _write_json(out_dir / "generation_config.json", generation)
    save_state_dict(state_dict, out_dir, max_shard_bytes)
    tokenizer.save_hf(out_dir)
    return out_dir
