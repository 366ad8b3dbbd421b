"""GGUF -> Hugging Face directory conversion: round trip through our loaders, loadable by transformers,
and the llama q/k row un-permutation agrees with transformers' own GGUF loader."""

from __future__ import annotations

import dataclasses
import json

import gguf
import pytest
import torch

from specserve.config import ModelConfig
from specserve.models.convert import convert_gguf_to_hf, hf_config_dict
from specserve.models.gguf_loader import dequantize, load_gguf, unpermute_rope_rows
from specserve.models.safetensors_loader import config_from_hf, load_hf_dir

MAX_SHARD_BYTES = 50_000_000


@pytest.fixture(scope="module")
def gguf_loaded(smollm2_gguf_path):
    return load_gguf(smollm2_gguf_path, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def converted(smollm2_gguf_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-hf")
    convert_gguf_to_hf(smollm2_gguf_path, out, max_shard_bytes=MAX_SHARD_BYTES, dtype=torch.bfloat16)
    return out


def test_gguf_config(gguf_loaded) -> None:
    config, state_dict, _ = gguf_loaded
    assert (config.architecture, config.hidden_size, config.num_hidden_layers) == ("llama", 576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and "lm_head.weight" not in state_dict
    assert config.max_position_embeddings == 8192 and config.rope_theta == 100000.0
    assert config.eos_token_ids == [2] and config.bos_token_id == 1
    assert state_dict["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert state_dict["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert len(state_dict) == 2 + 30 * 9


def test_sharded_layout(converted) -> None:
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((converted / s).exists() for s in shards)
    assert not (converted / "model.safetensors").exists()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (converted / name).exists()
    assert "chat_template" in json.loads((converted / "tokenizer_config.json").read_text())


def test_round_trip_is_identical(converted, gguf_loaded) -> None:
    config, state_dict, tokenizer = gguf_loaded
    config2, state_dict2, tokenizer2 = load_hf_dir(converted, dtype=torch.bfloat16)
    assert dataclasses.replace(config2, name=config.name) == config
    assert state_dict2.keys() == state_dict.keys()
    for name, tensor in state_dict.items():
        assert state_dict2[name].dtype == torch.bfloat16
        assert torch.equal(state_dict2[name], tensor), name
    assert tokenizer2.encode("Hi there 123 😀") == tokenizer.encode("Hi there 123 😀")
    assert tokenizer2.eos_token_ids == tokenizer.eos_token_ids


def test_transformers_loads_converted_dir(converted, gguf_loaded) -> None:
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.AutoConfig.from_pretrained(converted)
    assert hf_config.model_type == "llama" and hf_config.num_key_value_heads == 3
    assert hf_config.tie_word_embeddings
    model = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    _, _, tokenizer = gguf_loaded
    assert hf_tokenizer.encode("Hi there 123 <|im_end|>") == tokenizer.encode("Hi there 123 <|im_end|>")
    # functional check of the un-permuted q/k: rotate-half RoPE on these weights gives the right answer
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        next_id = int(model(ids).logits[0, -1].argmax())
    assert tokenizer.decode([next_id]) == " Paris"


def test_unpermute_matches_transformers_processor(smollm2_gguf_path) -> None:
    utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    processor = utils.LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    reader = gguf.GGUFReader(str(smollm2_gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    for name, heads in (("blk.0.attn_q.weight", 9), ("blk.0.attn_k.weight", 3), ("blk.7.attn_k.weight", 3)):
        t = tensors[name]
        raw = dequantize(t.data, t.tensor_type, [int(d) for d in reversed(t.shape.tolist())])
        theirs = torch.from_numpy(processor.process(raw.numpy(), name).weights.copy())
        assert torch.equal(unpermute_rope_rows(raw, heads), theirs)


def test_unpermute_worked_example() -> None:
    # one head, head_dim 4: rows [a0, b0, a1, b1] -> [a0, a1, b0, b1]
    w = torch.tensor([[0.0], [2.0], [1.0], [3.0]])  # [num_heads * head_dim, in_features]
    assert unpermute_rope_rows(w, num_heads=1).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_config_round_trip(arch: str, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = ModelConfig(architecture=arch, vocab_size=1000, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0},
                         max_position_embeddings=4096, attention_bias=arch == "qwen2",
                         qk_norm=arch == "qwen3",
                         bos_token_id=1, eos_token_ids=[2, 3], tie_word_embeddings=True)
    data = hf_config_dict(config, torch.bfloat16)
    assert config_from_hf(data) == dataclasses.replace(config, name="model")
    (tmp_path / "config.json").write_text(json.dumps(data))
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf_config.model_type == arch and hf_config.head_dim == 64 and hf_config.num_key_value_heads == 2


@pytest.mark.slow
def test_state_dict_matches_transformers_gguf_loader(smollm2_gguf_path) -> None:
    """The whole state dict equals what transformers builds from the same GGUF (~1 min on CPU)."""
    transformers = pytest.importorskip("transformers")
    config, state_dict, _ = load_gguf(smollm2_gguf_path, dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name, dtype=torch.float32)
    theirs = model.state_dict()
    for name, tensor in state_dict.items():
        assert torch.equal(tensor, theirs[name]), name
