"""The EAGLE-3 draft head (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test", arXiv 2503.01840) and its P-EAGLE variant (parallel drafting, arXiv 2602.01469).

The head drafts from the target's own features. Entry ``j`` of a request pairs the token at position
``j + 1`` with the target's hidden state at position ``j``: the fused low/mid/high features (the inputs of three
target layers, ``aux_layer_ids``) are projected by ``fc`` from ``n_aux * target_hidden`` to ``hidden``. The first
decoder layer attends over ``cat([input_layernorm(embed(token)), hidden_norm(hidden)])`` (2 * hidden wide);
later layers, when a head has more than one, are plain Llama layers. ``lm_head`` scores a reduced draft
vocabulary, mapped to target ids by ``target_id = draft_id + d2t[draft_id]``. The next sequential draft step
feeds back the last layer's output before the final norm (after it, with ``norm_output``).

P-EAGLE drafts all tokens in one pass: slots 2..k of a request take the learned ``mask_token_id`` embedding
and ``fc(mask_hidden)``, a learned shared feature in the fused ``n_aux * target_hidden`` space. A head either has
its own embedding table (``embed_tokens``, the mask token's row learned) or uses the target's table with one learned
row for the mask token (``mask_embedding``, ``[hidden_size]``): the same function, without storing a copy of the
target's table in the checkpoint (49,152 x 576 for SmolLM2, more than a 2-layer head's other weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.layers.argmax import greedy_argmax
from specserve.layers.attention import AttentionBackend, AttentionMetadata
from specserve.layers.linear import Linear
from specserve.layers.norm import RMSNorm
from specserve.layers.ops import TorchOps
from specserve.layers.rope import RotaryEmbedding
from specserve.models.llama import MLP, Attention, DecoderLayer

# Rows of a draft head's projection that take its Q8_0 block kernel (int8 activations) on CPU rather than oneDNN's
# packed fp32 GEMM (``EagleHead.quantize_cpu``). The kernel's arithmetic grows with the rows, the fp32 GEMM's much
# less: on 2 AVX2 cores, weights streamed cold, lm_head 32768 x 576 takes 0.72 vs 3.32 ms at 1 row, 2.38 vs 3.93 at
# 8, 4.68 vs 4.78 at 16, 9.10 vs 7.76 at 32; down 576 x 6144 0.52 vs 0.73 at 8, 0.99 vs 0.89 at 16
# (benchmarks/results/cpu_head_gemm.json).
HEAD_QUANT_MAX_ROWS = 12


@dataclass
class EagleHeadConfig:
    """Shape and wiring of an EAGLE-3 / P-EAGLE head (both checkpoint dialects load into this)."""

    layer: ModelConfig  # the head's decoder layers (hidden size, heads, rope, vocab_size = target vocab)
    target_hidden_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # target layer inputs fused by fc, low to high
    norm_before_residual: bool = False  # layer 0: residual = hidden_norm(hidden) instead of hidden
    norm_before_fc: bool = False  # one RMSNorm (input_norm) over the concatenated features before fc
    fc_norm: bool = False  # one RMSNorm per feature (fc_norm.{j}) before fc
    norm_output: bool = False  # feed norm(h) to the next draft step instead of h
    has_embedding: bool = True  # False: the head uses the target's embedding table
    mask_embedding: bool = False  # P-EAGLE on the target's table: a learned embedding for mask_token_id
    parallel: bool = False  # P-EAGLE
    mask_token_id: int | None = None  # P-EAGLE slots 2..k
    num_spec_tokens: int | None = None  # the checkpoint's suggestion, if it has one
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.draft_vocab_size <= self.layer.vocab_size:
            raise ValueError("draft_vocab_size: must be in [1, vocab_size]")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("fc_norm: cannot be combined with norm_before_fc")
        if self.parallel and self.mask_token_id is None:
            raise ValueError("mask_token_id: a P-EAGLE head needs the id of its mask token")
        if self.mask_embedding and (self.has_embedding or not self.parallel):
            raise ValueError("mask_embedding: only a P-EAGLE head on the target's embedding table has one")

    @property
    def fc_in_features(self) -> int:
        return len(self.aux_layer_ids) * self.target_hidden_size


class EagleFirstLayer(nn.Module):
    """Layer 0: attention over [normed embedding | normed feature] (2 * hidden wide), then the MLP."""

    def __init__(self, config: ModelConfig, norm_before_residual: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Attention(config)
        attn = self.self_attn
        self.self_attn.qkv_proj = Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=config.attention_bias)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.norm_before_residual = norm_before_residual
        self.ops = TorchOps()

    def forward(
        self,
        embeds: torch.Tensor,  # [num_tokens, hidden_size]
        hidden: torch.Tensor,  # [num_tokens, hidden_size] fc(target features) or the previous step's output
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual), each [num_tokens, hidden_size]
        ops = self.ops
        e = ops.rms_norm(embeds, self.input_layernorm.weight, self.input_layernorm.eps)
        h = ops.rms_norm(hidden, self.hidden_norm.weight, self.hidden_norm.eps)
        residual = h.clone() if self.norm_before_residual else hidden.clone()
        x = self.self_attn(torch.cat([e, h], dim=-1), cos_sin, kv_cache, meta, backend)
        x = ops.fused_add_rms_norm(x, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return self.mlp(x), residual


class EagleHead(nn.Module):
    def __init__(self, config: EagleHeadConfig, max_position: int) -> None:
        super().__init__()
        c = config.layer
        self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if config.has_embedding else None
        self.target_embed: nn.Embedding | None = None  # set by the proposer when the head has no embedding
        self.fc = Linear(config.fc_in_features, c.hidden_size, bias=False)
        self.input_norm = RMSNorm(config.fc_in_features, c.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, c.rms_norm_eps)
                                     for _ in config.aux_layer_ids) if config.fc_norm else None
        self.layers = nn.ModuleList([EagleFirstLayer(c, config.norm_before_residual)]
                                    + [DecoderLayer(c) for _ in range(c.num_hidden_layers - 1)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.mask_hidden = nn.Parameter(torch.zeros(config.fc_in_features)) if config.parallel else None
        self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size)) if config.mask_embedding else None
        self.max_position = max_position
        self.rope: RotaryEmbedding | None = None
        self.ops = TorchOps()

    def init_rope(self, device: torch.device) -> None:
        """Build the rotary tables on ``device`` in the head's dtype (call after any ``.to(dtype)``)."""
        c = self.config.layer
        self.rope = RotaryEmbedding(c.head_dim, self.max_position, c.rope_theta, c.rope_scaling, device,
                                    self.norm.weight.dtype)

    def set_ops(self, ops: TorchOps) -> None:
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def pack_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    @torch.no_grad()
    def quantize_cpu(self, qtype: str) -> int:
        """Run every projection (``fc``, attention, MLP, ``lm_head``) from GGUF blocks of its own weight
        (``layers/quant_cpu.py``): a CPU draft step reads every head weight once, so 8-bit blocks read ~4x fewer
        bytes than fp32 ones. Up to ``HEAD_QUANT_MAX_ROWS`` rows take the block kernel with int8 activations
        (integer dot products; a draft needs no row independence, the verifier decides); more rows, where the
        kernel's arithmetic costs more than oneDNN's fp32 GEMM, take the fp32 path. The float weights are replaced
        by the blocks' dequantized values, so both paths compute the same function up to the rounding of the
        activations. Call before ``pack_weights``; CPU float32 only. Returns how many projections were quantized."""
        from specserve.layers.quant_cpu import BLOCK_SIZE, QuantizedWeight
        count = 0
        for module in self.modules():
            if isinstance(module, Linear) and module.in_features % BLOCK_SIZE == 0:
                if module.weight.device.type != "cpu" or module.weight.dtype != torch.float32:
                    raise ValueError("quantize_cpu: the head must be float32 on the CPU")
                quant = QuantizedWeight.from_float(module.weight, qtype)
                module.weight.copy_(quant.dequantize())
                module.quant = quant
                module.activation_quant = "q8"
                module.quant_max_rows = HEAD_QUANT_MAX_ROWS
                quant.int8_codes()  # the int8 kernel's layout, built now rather than on the first draft
                count += 1
        return count

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden_size]
        table = self.embed_tokens if self.embed_tokens is not None else self.target_embed
        embeds = table(token_ids)
        if self.mask_embedding is None:
            return embeds
        is_mask = (token_ids == self.config.mask_token_id).unsqueeze(-1)  # [n, 1]
        return torch.where(is_mask, self.mask_embedding.to(embeds.dtype), embeds)

    def fuse(
        self,
        features: torch.Tensor,  # [num_tokens, n_aux * target_hidden_size] target layer inputs, low to high
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        ops = self.ops
        if self.input_norm is not None:
            features = ops.rms_norm(features, self.input_norm.weight, self.input_norm.eps)
        elif self.fc_norm is not None:
            parts = features.split(self.config.target_hidden_size, dim=-1)
            features = torch.cat([ops.rms_norm(p.contiguous(), n.weight, n.eps) for p, n in zip(parts, self.fc_norm)],
                                 dim=-1)
        return self.fc(features)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size] fused target features or fed-back draft output
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per head layer
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [num_tokens, hidden], fed-forward [num_tokens, hidden])
        embeds = self.embed(input_ids)
        cos_sin = self.rope.cos_sin(positions, hidden.dtype)
        x, residual = self.layers[0](embeds, hidden, cos_sin, kv_caches[0], meta, backend)
        for i, layer in enumerate(self.layers[1:], start=1):
            x, residual = layer(x, residual, cos_sin, kv_caches[i], meta, backend)
        normed = self.ops.fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)  # residual += x
        return normed, (normed if self.config.norm_output else residual)

    def draft_token_ids(
        self,
        normed: torch.Tensor,  # [num_rows, hidden_size]
    ) -> torch.Tensor:  # [num_rows] target-vocabulary ids of the greedy draft
        draft_ids = greedy_argmax(self.lm_head(normed))
        return draft_ids + self.d2t[draft_ids]
