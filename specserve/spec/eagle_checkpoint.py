"""Load and save EAGLE-3 / P-EAGLE heads so that published checkpoints load unchanged.

Two dialects are read (facts from the vllm-project/speculators, sgl-project/SpecForge and SafeAILab/EAGLE
repositories; no code taken):

- speculators (Red Hat): ``speculators_model_type`` "eagle3" | "peagle"; the layers' shape sits in
  ``transformer_layer_config`` (a Hugging Face config written as a diff against the class defaults, so missing
  keys take the Llama / Qwen3 defaults); top-level ``draft_vocab_size``, ``norm_before_residual``,
  ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` (inputs of those target layers),
  ``speculators_config.proposal_methods[..].speculative_tokens``, and for P-EAGLE ``mask_token_id``.
  Weights ``layers.{i}.*``.
- EAGLE-3 / SpecForge: a flat Llama config with ``architectures`` ["LlamaForCausalLMEagle3"] (or
  "PEagleDraftModel"), ``draft_vocab_size``, optional ``target_hidden_size`` and
  ``eagle_config.eagle_aux_hidden_state_layer_ids``, which SpecForge counts as *outputs* of layers (SGLang adds
  one when capturing), so they are shifted by one here to name layer inputs. Weights ``midlayer.*`` = layer 0.

Both may prefix weights with ``model.``; ``embed_tokens`` is optional (the target's is used; a P-EAGLE head on
the target's table may carry ``mask_embedding``, ``[hidden]``, its learned mask-token row), ``d2t`` (int64
offsets, ``target_id = draft_id + d2t[draft_id]``) and ``t2d`` (bool mask over the target vocabulary) are
absent when the draft vocabulary is the target's. With no layer ids anywhere, the EAGLE-3 default
``(2, L // 2, L - 3)`` of an L-layer target applies.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from specserve.config import ModelConfig
from specserve.models.loader import init_random_weights
from specserve.spec.eagle_head import EagleHead, EagleHeadConfig

# transformers' class defaults, for keys a diff-serialised transformer_layer_config leaves out.
_LAYER_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
                  attention_bias=False),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6,
                  rope_theta=10000.0, max_position_embeddings=32768, attention_bias=False),
}
FLAT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "PEagleDraftModel", "Eagle3LlamaForCausalLM")


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    return (2, num_target_layers // 2, num_target_layers - 3)


def _layer_config(hf: dict[str, Any]) -> ModelConfig:
    model_type = hf.get("model_type", "llama")
    kind = "qwen3" if model_type == "qwen3" else "llama"
    d = {**_LAYER_DEFAULTS[kind], **{k: v for k, v in hf.items() if v is not None}}
    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return ModelConfig(
        architecture=kind, vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]), num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=int(d["num_attention_heads"]),
        num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
        head_dim=d.get("head_dim"), rms_norm_eps=float(d["rms_norm_eps"]),
        rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))), rope_scaling=scaling,
        max_position_embeddings=int(d["max_position_embeddings"]), attention_bias=bool(d.get("attention_bias")),
        qk_norm=kind == "qwen3", name="eagle-head")


def head_config_from_json(cfg: dict[str, Any], num_target_layers: int, target_vocab_size: int,
                          has_embedding: bool = True, mask_embedding: bool = False) -> EagleHeadConfig:
    """Either dialect's config.json -> ``EagleHeadConfig``. Raises ValueError naming what is wrong."""
    kind = cfg.get("speculators_model_type")
    if kind is not None:
        if kind not in ("eagle3", "peagle"):
            raise ValueError(f"speculators_model_type: {kind!r} is not an EAGLE-3 or P-EAGLE head")
        if "transformer_layer_config" not in cfg:
            raise ValueError("transformer_layer_config: missing from the speculators config")
        layer = _layer_config(cfg["transformer_layer_config"])
        aux = cfg.get("eagle_aux_hidden_state_layer_ids")
        parallel = kind == "peagle"
        spec_cfg = cfg.get("speculators_config") or {}
        methods = spec_cfg.get("proposal_methods") or []
        default = spec_cfg.get("default_proposal_method")
        chosen = next((m for m in methods if m.get("proposal_type") == default), methods[0] if methods else {})
        num_spec = chosen.get("speculative_tokens")
    else:
        archs = cfg.get("architectures") or []
        if not any(a in FLAT_ARCHITECTURES for a in archs):
            raise ValueError(f"architectures: {archs!r} is neither a speculators config nor an EAGLE-3 head "
                             f"({', '.join(FLAT_ARCHITECTURES)})")
        layer = _layer_config(cfg)
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = None if ids is None else [i + 1 for i in ids]  # SpecForge: output of layer i = input of layer i + 1
        parallel = "PEagleDraftModel" in archs or bool(cfg.get("parallel_drafting"))
        num_spec = None
    if layer.vocab_size != target_vocab_size:
        raise ValueError(f"vocab_size: the head was trained for a {layer.vocab_size}-token vocabulary, the target "
                         f"has {target_vocab_size}")
    aux_ids = tuple(int(i) for i in aux) if aux else default_aux_layer_ids(num_target_layers)
    if any(not 0 <= i <= num_target_layers for i in aux_ids):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids: {list(aux_ids)} outside the target's "
                         f"{num_target_layers} layers")
    mask = cfg.get("mask_token_id", cfg.get("pard_token", cfg.get("ptd_token_id")))
    return EagleHeadConfig(
        layer=layer, target_hidden_size=int(cfg.get("target_hidden_size") or layer.hidden_size),
        draft_vocab_size=int(cfg.get("draft_vocab_size") or layer.vocab_size), aux_layer_ids=aux_ids,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        norm_before_fc=bool(cfg.get("norm_before_fc", False)), fc_norm=bool(cfg.get("fc_norm", False)),
        norm_output=bool(cfg.get("norm_output", False)) if kind is not None else False,
        has_embedding=has_embedding, mask_embedding=mask_embedding and parallel and not has_embedding,
        parallel=parallel, mask_token_id=None if mask is None else int(mask),
        num_spec_tokens=num_spec)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            state.update(load_file(str(f)))
    elif (path / "pytorch_model.bin").exists():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"speculative.model: no *.safetensors or pytorch_model.bin in {path}")
    out = {}
    for name, t in state.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        out[name] = t
    return out


@torch.no_grad()
def load_head_state(head: EagleHead, state: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint-named weights into the head, fusing q|k|v and gate|up. Every parameter must be covered."""
    loaded: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise ValueError(f"speculative.model: checkpoint is missing weight {name}")
        return state[name]

    def put(name: str, tensor: torch.Tensor) -> None:
        target = head.get_parameter(name) if name != "d2t" else head.d2t
        if tensor.numel() != target.numel():
            raise ValueError(f"speculative.model: weight {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(tensor.reshape(target.shape))
        loaded.add(name)

    c = head.config
    if head.embed_tokens is not None:
        put("embed_tokens.weight", take("embed_tokens.weight"))
    put("fc.weight", take("fc.weight"))
    if head.input_norm is not None:
        put("input_norm.weight", take("input_norm.weight"))
    if head.fc_norm is not None:
        for j in range(len(head.fc_norm)):
            put(f"fc_norm.{j}.weight", take(f"fc_norm.{j}.weight"))
    for i in range(len(head.layers)):
        p = f"layers.{i}."
        names = ["input_layernorm", "post_attention_layernorm"] + (["hidden_norm"] if i == 0 else [])
        for n in names:
            put(p + n + ".weight", take(p + n + ".weight"))
        a = p + "self_attn."
        put(a + "qkv_proj.weight", torch.cat([take(a + "q_proj.weight"), take(a + "k_proj.weight"),
                                              take(a + "v_proj.weight")]))
        if c.layer.attention_bias:
            put(a + "qkv_proj.bias", torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"),
                                                take(a + "v_proj.bias")]))
        put(a + "o_proj.weight", take(a + "o_proj.weight"))
        if c.layer.qk_norm:
            put(a + "q_norm.weight", take(a + "q_norm.weight"))
            put(a + "k_norm.weight", take(a + "k_norm.weight"))
        m = p + "mlp."
        put(m + "gate_up_proj.weight", torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]))
        put(m + "down_proj.weight", take(m + "down_proj.weight"))
    put("norm.weight", take("norm.weight"))
    put("lm_head.weight", take("lm_head.weight"))
    if c.draft_vocab_size != c.layer.vocab_size:
        put("d2t", take("d2t"))
    if head.mask_hidden is not None:
        put("mask_hidden", take("mask_hidden"))
    if head.mask_embedding is not None:
        put("mask_embedding", take("mask_embedding"))
    missing = {n for n, _ in head.named_parameters()} - loaded
    if missing:
        raise ValueError(f"speculative.model: weights not loaded: {sorted(missing)[:5]}")


def build_head(config: EagleHeadConfig, max_position: int, dtype: torch.dtype, device: torch.device) -> EagleHead:
    with torch.device("meta"):
        head = EagleHead(config, max_position)
    head = head.to_empty(device=device).to(dtype)  # floating-point tensors only: d2t stays int64
    head.d2t.zero_()
    head.init_rope(device)
    return head.eval()


def load_eagle_head(path: str | Path, num_target_layers: int, target_vocab_size: int, max_position: int,
                    dtype: torch.dtype, device: torch.device) -> EagleHead:
    path = Path(path).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"speculative.model: {path} has no config.json")
    state = _read_weights(path)
    config = head_config_from_json(json.loads((path / "config.json").read_text()), num_target_layers,
                                   target_vocab_size, has_embedding="embed_tokens.weight" in state,
                                   mask_embedding="mask_embedding" in state)
    if "mask_embedding" in state and not config.mask_embedding:  # a row no head of this kind would use
        kind = "a P-EAGLE head with its own embedding table" if config.parallel else "an EAGLE-3 head"
        raise ValueError(f"speculative.model: {path} is {kind} but carries mask_embedding, which only a P-EAGLE "
                         "head on the target's embedding table uses")
    head = build_head(config, max_position, dtype, device)
    load_head_state(head, {k: v.to(device) if k == "d2t" else v.to(device, dtype) for k, v in state.items()})
    return head


@torch.no_grad()
def with_embedding_table(
    head: EagleHead,
    table: torch.Tensor,  # [vocab_size, hidden_size] the target's embedding table
) -> EagleHead:
    """A P-EAGLE head on the target's table (its learned mask-token row in ``mask_embedding``) as the same head with
    its own embedding table: the target's rows, and the learned row at ``mask_token_id``. It drafts exactly as
    ``head`` does; it is the layout vLLM reads (there the mask token's embedding is a row of ``embed_tokens``), at
    the cost of a copy of the table (49,152 x 576 for SmolLM2)."""
    c = head.config
    if not c.mask_embedding:
        raise ValueError("convert-head: only a P-EAGLE head with a learned mask row (mask_embedding) and no "
                         "embedding table of its own needs the target's table written in")
    if tuple(table.shape) != (c.layer.vocab_size, c.layer.hidden_size):
        raise ValueError(f"convert-head: the target's embedding table is {tuple(table.shape)}, the head expects "
                         f"{(c.layer.vocab_size, c.layer.hidden_size)}")
    weight = head.norm.weight
    new = build_head(dataclasses.replace(c, has_embedding=True, mask_embedding=False), head.max_position,
                     weight.dtype, weight.device)
    state = {k: v for k, v in head.state_dict().items()
             if k != "mask_embedding" and not k.startswith("target_embed.")}
    rows = table.to(weight.device, weight.dtype).clone()
    rows[c.mask_token_id] = head.mask_embedding
    new.load_state_dict(state | {"embed_tokens.weight": rows})
    return new


def head_layer_config(target: ModelConfig, num_layers: int, name: str) -> ModelConfig:
    """``num_layers`` Llama decoder layers of the target's width, heads and rope, for a head drafting for it."""
    fields = {k: getattr(target, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                               "num_attention_heads", "num_key_value_heads", "head_dim",
                                               "rms_norm_eps", "rope_theta", "rope_scaling",
                                               "max_position_embeddings")}
    return ModelConfig(architecture="llama", num_hidden_layers=num_layers, name=name, **fields)


def head_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """Low, mid, high target features (EAGLE-3's choice); a target under 4 layers takes (0, L // 2, L)."""
    if num_target_layers >= 4:
        return default_aux_layer_ids(num_target_layers)
    return (0, num_target_layers // 2, num_target_layers)


def dummy_head(target: ModelConfig, parallel: bool, seed: int, max_position: int, dtype: torch.dtype,
               device: torch.device, num_layers: int | None = None, **overrides) -> EagleHead:
    """A random head shaped for ``target``: one layer (two for P-EAGLE), a draft vocabulary of half the target's
    ids (a random sorted subset, so the d2t mapping is exercised) and the target's embedding table.
    ``overrides`` replace ``EagleHeadConfig`` fields (norm_before_residual, has_embedding, fc_norm, ...)."""
    gen = torch.Generator().manual_seed(seed)
    layer = head_layer_config(target, num_layers or (2 if parallel else 1), "eagle-head-dummy")
    draft_vocab = max(1, target.vocab_size // 2)
    fields = {"target_hidden_size": target.hidden_size, "draft_vocab_size": draft_vocab,
              "aux_layer_ids": head_aux_layer_ids(target.num_hidden_layers),
              "has_embedding": False, "mask_embedding": parallel, "parallel": parallel,
              "mask_token_id": target.vocab_size - 1 if parallel else None}
    config = EagleHeadConfig(layer=layer, **{**fields, **overrides})
    head = build_head(config, max_position, dtype, device)
    init_random_weights(head, gen)
    with torch.no_grad():
        selected = torch.randperm(target.vocab_size, generator=gen)[:draft_vocab].sort().values
        head.d2t.copy_(selected - torch.arange(draft_vocab))
    return head


@torch.no_grad()
def save_speculators(head: EagleHead, path: str | Path, verifier: str | None = None,
                     max_shard_bytes: int | None = None, verifier_architectures: tuple[str, ...] = ()) -> None:
    """Write ``head`` as a speculators-format checkpoint: config.json + model.safetensors, or shards of at most
    ``max_shard_bytes`` plus their index. ``verifier_architectures``: the target's HF architecture names, when
    known (the head's own layers are always Llama layers, whatever the target)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = head.config
    lc = c.layer
    layer_cfg = {
        "model_type": lc.architecture if lc.architecture == "qwen3" else "llama",
        "architectures": ["Qwen3ForCausalLM" if lc.architecture == "qwen3" else "LlamaForCausalLM"],
        "vocab_size": lc.vocab_size, "hidden_size": lc.hidden_size, "intermediate_size": lc.intermediate_size,
        "num_hidden_layers": lc.num_hidden_layers, "num_attention_heads": lc.num_attention_heads,
        "num_key_value_heads": lc.num_key_value_heads, "head_dim": lc.head_dim, "rms_norm_eps": lc.rms_norm_eps,
        "rope_theta": lc.rope_theta, "rope_scaling": lc.rope_scaling,
        "max_position_embeddings": lc.max_position_embeddings, "attention_bias": lc.attention_bias,
        "mlp_bias": False, "tie_word_embeddings": False,
    }
    kind = "peagle" if c.parallel else "eagle3"
    cfg: dict[str, Any] = {
        "speculators_model_type": kind,
        "architectures": ["PEagleSpeculator" if c.parallel else "Eagle3Speculator"],
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.num_spec_tokens or 3,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }
    if c.parallel:
        cfg["mask_token_id"] = c.mask_token_id
    state: dict[str, torch.Tensor] = {}
    for name, t in head.state_dict().items():
        if name == "d2t":
            continue
        if ".qkv_proj." in name:
            a = head.layers[int(name.split(".")[1])].self_attn
            q, k, v = t.split([a.q_size, a.kv_size, a.kv_size])
            suffix = name.rsplit(".", 1)[1]
            base = name.split("qkv_proj")[0]
            state.update({f"{base}q_proj.{suffix}": q, f"{base}k_proj.{suffix}": k, f"{base}v_proj.{suffix}": v})
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2)
            base = name.split("gate_up_proj")[0]
            state.update({base + "gate_proj.weight": gate, base + "up_proj.weight": up})
        elif name == "mask_hidden":
            state[name] = t.reshape(1, 1, -1)
        else:
            state[name] = t
    if c.draft_vocab_size != lc.vocab_size:
        state["d2t"] = head.d2t.clone()
        t2d = torch.zeros(lc.vocab_size, dtype=torch.bool)
        t2d[torch.arange(c.draft_vocab_size) + head.d2t.cpu()] = True
        state["t2d"] = t2d
    from specserve.models.convert import save_state_dict  # the converter's (sharding) weight writer
    save_state_dict({k: v.detach().cpu() for k, v in state.items()}, path, max_shard_bytes)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
