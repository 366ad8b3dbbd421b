"""Llama-architecture decoder (Touvron et al., arXiv 2302.13971; Llama 3, arXiv 2407.21783), which also
covers Qwen2 (bias on the q/k/v projections) and Qwen3 (per-head RMSNorm on q and k).

The model reads a packed ragged batch: ``input_ids`` and ``positions`` are ``[num_tokens]`` over all
sequences of the step, and attention goes through the backend with the step's metadata. Projections are
fused at load time (q|k|v into one matrix, gate|up into one) to halve the number of matmul launches.

FP8 projections (``quant_gpu.Fp8Linear``, per-token activations) can take their input already quantized by the
op that produces it (``TritonOps.rms_norm_fp8`` / ``fused_add_rms_norm_fp8`` / ``silu_and_mul_fp8``: the same
e4m3 bits as the projection's own quantizer, one launch fewer each) when ``quant_tiles.FUSE_FP8_ACT_QUANT`` is
on (read at every call) and the layer's ops provide them; otherwise, and with ``TorchOps``, nothing changes.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.layers import quant_tiles
from specserve.layers.attention import AttentionBackend, AttentionMetadata
from specserve.layers.linear import Linear, dense_linear, pack_weight, packed_linear, use_quant_kernel
from specserve.layers.norm import RMSNorm
from specserve.layers.ops import TorchOps
from specserve.layers.quant_cpu import QuantizedWeight, load_extension, quant_linear
from specserve.layers.quant_gpu import Fp8Activations, Fp8Linear
from specserve.layers.rope import RotaryEmbedding


def fuse_fp8_input(proj: nn.Module, ops: TorchOps, op_name: str) -> bool:
    """Whether ``proj``'s input should come from ``ops.<op_name>`` (an ``_fp8`` op: the producer with the
    per-token FP8 quantizer fused in): the switch ``quant_tiles.FUSE_FP8_ACT_QUANT`` is on, ``proj`` is an
    ``Fp8Linear`` quantizing activations per token, and ``ops`` has the fused op (``TritonOps``)."""
    return (quant_tiles.FUSE_FP8_ACT_QUANT and isinstance(proj, Fp8Linear) and proj.activation_quant == "per_token"
            and hasattr(ops, op_name))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.ops = TorchOps()

    def forward(
        self,
        x: torch.Tensor | Fp8Activations,  # [num_tokens, hidden_size] (e4m3 + scales: qkv_proj is an Fp8Linear)
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_tokens, 1, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        n, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)  # [n, q_size + 2 * kv_size]: q | k | v
        qk_size = self.q_size + self.kv_size
        if self.q_norm is None:
            qk = qkv[:, :qk_size].view(n, self.num_heads + self.num_kv_heads, d)  # rotated in place, inside qkv
        else:
            q = self.ops.rms_norm(qkv[:, :self.q_size].reshape(-1, d), self.q_norm.weight, self.q_norm.eps)
            k = self.ops.rms_norm(qkv[:, self.q_size:qk_size].reshape(-1, d), self.k_norm.weight, self.k_norm.eps)
            qk = torch.cat([q.view(n, self.num_heads, d), k.view(n, self.num_kv_heads, d)], dim=1)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, qk_size:].view(n, self.num_kv_heads, d)
        if getattr(backend, "fuses_rope", False):  # rotates q and k in its cache-write launch
            out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, rope=cos_sin)  # [n, h, d]
        else:
            self.ops.rope_(qk, *cos_sin)
            out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta)  # [n, h, d]
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.ops = TorchOps()
        self._one_row_state: tuple[torch.Tensor, torch.Tensor] | None = None  # (barrier counter, amax slots)

    def fused_one_row(
        self,
        x: torch.Tensor,  # [1, hidden_size]: the attention block's output
        residual: torch.Tensor,  # [1, hidden_size]: the residual stream before x is added
        norm: RMSNorm,  # post_attention_layernorm
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # (MLP output, residual + x), each [1, hidden_size]; or None
        """``norm`` and the block in one persistent launch (``triton_fused_mlp.fused_mlp_fp8``, per-token e4m3
        activations as ``Fp8Linear``) when ``quant_tiles.FUSED_MLP_ONE_ROW`` is set, x is one bf16 row on CUDA,
        both projections are bias-free per-token ``Fp8Linear``s and the shapes tile; else None (the caller runs
        the usual ops). Its counter and amax slots are made on the first eager call (the engine runs a step
        before capturing a graph), never while a graph is being captured."""
        cfg = quant_tiles.FUSED_MLP_ONE_ROW
        gate_up, down = self.gate_up_proj, self.down_proj
        if (cfg is None or x.shape[0] != 1 or not x.is_cuda or x.dtype != torch.bfloat16
                or not isinstance(gate_up, Fp8Linear) or not isinstance(down, Fp8Linear)
                or gate_up.bias is not None or down.bias is not None
                or gate_up.activation_quant != "per_token" or down.activation_quant != "per_token"):
            return None
        from specserve.layers import triton_fused_mlp  # lazily: Triton only where it runs
        tiles = {k: v for k, v in cfg.items() if k != "programs_per_sm"}
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count * cfg.get("programs_per_sm", 1)
        if triton_fused_mlp.tiling_problem(x.shape[1], self.intermediate_size, programs, tiles["bn1"],
                                           tiles["bk1"], tiles["bn2"], tiles["bk2"]):
            return None
        if self._one_row_state is None:
            if torch.cuda.is_current_stream_capturing():
                return None
            self._one_row_state = (torch.zeros(1, dtype=torch.int32, device=x.device),
                                   torch.zeros(2, dtype=torch.int32, device=x.device))
        counter, amax = self._one_row_state
        return triton_fused_mlp.fused_mlp_fp8(
            x, residual, norm.weight, gate_up.weight, gate_up.weight_scale, down.weight, down.weight_scale,
            norm.eps, counter, programs, amax=amax, **tiles)

    def forward(
        self,
        x: torch.Tensor | Fp8Activations,  # [num_tokens, hidden_size] (e4m3 + scales: gate_up is an Fp8Linear)
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        if fuse_fp8_input(self.down_proj, self.ops, "silu_and_mul_fp8"):
            return self.down_proj(self.ops.silu_and_mul_fp8(gate_up))
        return self.down_proj(self.ops.silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.ops = TorchOps()

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]: the previous layer's MLP output (or the embeddings)
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]: the residual stream before x is added
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_tokens, 1, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual), each [num_tokens, hidden_size]
        """Pre-norm block with the residual carried separately, so each add fuses into the next norm:
        ``residual += x; h = norm(residual); residual += attn(h); out = mlp(norm(residual))``. The
        additions happen in the same order as ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""
        ln1, ln2, ops = self.input_layernorm, self.post_attention_layernorm, self.ops
        # the norms may hand the qkv / gate_up projections their input already FP8-quantized (see fuse_fp8_input)
        fuse_qkv = fuse_fp8_input(self.self_attn.qkv_proj, ops, "fused_add_rms_norm_fp8")
        if residual is None:
            residual = x
            h = ops.rms_norm_fp8(x, ln1.weight, ln1.eps) if fuse_qkv else ops.rms_norm(x, ln1.weight, ln1.eps)
        elif fuse_qkv:
            h = ops.fused_add_rms_norm_fp8(x, residual, ln1.weight, ln1.eps)
        else:
            h = ops.fused_add_rms_norm(x, residual, ln1.weight, ln1.eps)
        h = self.self_attn(h, cos_sin, kv_cache, meta, backend)
        fused = self.mlp.fused_one_row(h, residual, ln2)
        if fused is not None:
            return fused
        if fuse_fp8_input(self.mlp.gate_up_proj, ops, "fused_add_rms_norm_fp8"):
            h = ops.fused_add_rms_norm_fp8(h, residual, ln2.weight, ln2.eps)
        else:
            h = ops.fused_add_rms_norm(h, residual, ln2.weight, ln2.eps)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 dense decoder with an LM head."""

    def __init__(self, config: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.max_position = max_position
        self.rope: RotaryEmbedding | None = None  # built in init_rope() once the device is known
        self._packed_head: torch.Tensor | None = None
        self._quant_head = None  # QuantizedWeight of the LM head, when the checkpoint has one
        self.quantized_head: nn.Module | None = None  # FP8 / INT4 LM head (models/quantize.py, lm_head=True)
        self._head_activation_quant = "none"  # how the LM head's kernel takes the hidden states
        self.ops = TorchOps()

    def set_ops(self, ops: TorchOps) -> None:
        """Use ``ops`` (e.g. the fused CPU kernels) for every norm, activation and rotary embedding."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def pack_weights(self) -> None:
        """Pre-pack every projection (and the LM head) for fast CPU GEMMs; a no-op where unsupported.
        Call again after changing weights."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.quantized_head is None:  # a quantized head runs its own kernel
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self._packed_head = pack_weight(weight)

    def init_rope(self, device: torch.device) -> None:
        """Build the rotary tables on ``device`` in the model's dtype (call after any ``.to(dtype)``)."""
        c = self.config
        self.rope = RotaryEmbedding(c.head_dim, self.max_position, c.rope_theta, c.rope_scaling, device,
                                    self.embed_tokens.weight.dtype)

    def attach_quantized(self, tensors: dict, activation_quant: str = "none") -> int:
        """Give projections their checkpoint's GGUF blocks (``{hf_name: QuantizedTensor}``) so small batches
        run the block-quantized CPU kernel, taking activations as ``activation_quant`` ("none": float32, "q8":
        int8 per block of 32). Returns how many layers got them (0 if the kernel is unavailable).
        Fused projections get blocks only when all their parts are quantized in one format."""
        if load_extension() is None:
            return 0

        def block_weight(name: str):
            t = tensors.get(name)
            if t is None:
                return None
            w = QuantizedWeight.from_gguf_bytes(t.raw, t.qtype, t.out_features, t.in_features)
            return w if t.row_order is None else w.rows(t.row_order)

        def fused(names: list[str]):
            parts = [block_weight(n) for n in names]
            if any(p is None for p in parts) or len({p.qtype for p in parts}) != 1:
                return None
            return QuantizedWeight.cat(parts)

        count = 0
        for i, layer in enumerate(self.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            for module, names in ((layer.self_attn.qkv_proj, [a + "q_proj.weight", a + "k_proj.weight",
                                                               a + "v_proj.weight"]),
                                  (layer.self_attn.o_proj, [a + "o_proj.weight"]),
                                  (layer.mlp.gate_up_proj, [m + "gate_proj.weight", m + "up_proj.weight"]),
                                  (layer.mlp.down_proj, [m + "down_proj.weight"])):
                module.quant = fused(names)
                count += module.quant is not None
        self._quant_head = block_weight("model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight")
        self.set_activation_quant(activation_quant)
        return count + (self._quant_head is not None)

    def set_activation_quant(self, activation_quant: str) -> None:
        """How the block-quantized kernels take activations: "none" (float32) or "q8" (int8 per block of 32)."""
        from specserve.layers.quant_cpu import ACTIVATION_QUANTS
        if activation_quant not in ACTIVATION_QUANTS:
            raise ValueError(f"activation_quant must be one of {ACTIVATION_QUANTS}, got {activation_quant!r}")
        for module in self.modules():
            if isinstance(module, Linear):
                module.activation_quant = activation_quant
                if activation_quant == "q8" and module.quant is not None:
                    module.quant.int8_codes()  # the int8 kernel's code layout, built now rather than on step one
        self._head_activation_quant = activation_quant

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        meta: AttentionMetadata,
        backend: AttentionBackend,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final normed hidden states ``[num_tokens, hidden_size]`` and the inputs of the
        layers named in ``aux_layer_ids``, in ascending id order (EAGLE-3 fuses low/mid/high target features;
        id ``num_hidden_layers`` is the last layer's output before the final norm)."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        aux: list[torch.Tensor] = []
        residual = None
        for i, layer in enumerate(self.layers):
            if i in aux_layer_ids:
                aux.append(x if residual is None else residual + x)  # the layer's input hidden state
            x, residual = layer(x, residual, cos_sin, kv_caches[i], meta, backend)
        if len(self.layers) in aux_layer_ids:
            aux.append(residual + x)  # id num_layers: the last layer's output, before the final norm
        return self.ops.fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps), aux

    def compute_logits(
        self,
        hidden: torch.Tensor,  # [num_rows, hidden_size]
    ) -> torch.Tensor:  # [num_rows, vocab_size] float32
        if self.quantized_head is not None:
            return self.quantized_head(hidden).float()
        if self._quant_head is not None and use_quant_kernel(hidden.shape[0], self._head_activation_quant):
            return quant_linear(hidden, self._quant_head, None, self._head_activation_quant).float()
        if self._packed_head is not None:
            return packed_linear(hidden, self._packed_head, None).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return dense_linear(hidden, weight, float_out=True)

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, fusing q|k|v and gate|up. Every parameter must be covered."""
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            param = self.get_parameter(name)
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
            param.copy_(tensor)
            loaded.add(name)

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise ValueError(f"checkpoint is missing weight {name}")
            return state[name]

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm.weight", take("model.norm.weight"))
        if self.lm_head is not None:
            put("lm_head.weight", take("lm_head.weight"))
        for i in range(self.config.num_hidden_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            put(dst + "input_layernorm.weight", take(src + "input_layernorm.weight"))
            put(dst + "post_attention_layernorm.weight", take(src + "post_attention_layernorm.weight"))
            a = src + "self_attn."
            attn, mlp = self.layers[i].self_attn, self.layers[i].mlp
            if isinstance(attn.qkv_proj, Linear):  # else loaded already quantized (models/quantize.py, AWQ)
                put(dst + "self_attn.qkv_proj.weight", torch.cat(
                    [take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")]))
            if self.config.attention_bias and isinstance(attn.qkv_proj, Linear):
                put(dst + "self_attn.qkv_proj.bias", torch.cat(
                    [take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")]))
            if isinstance(attn.o_proj, Linear):
                put(dst + "self_attn.o_proj.weight", take(a + "o_proj.weight"))
            if self.config.qk_norm:
                put(dst + "self_attn.q_norm.weight", take(a + "q_norm.weight"))
                put(dst + "self_attn.k_norm.weight", take(a + "k_norm.weight"))
            m = src + "mlp."
            if isinstance(mlp.gate_up_proj, Linear):
                put(dst + "mlp.gate_up_proj.weight",
                    torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]))
            if isinstance(mlp.down_proj, Linear):
                put(dst + "mlp.down_proj.weight", take(m + "down_proj.weight"))
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise ValueError(f"weights not loaded: {sorted(missing)[:5]}")
