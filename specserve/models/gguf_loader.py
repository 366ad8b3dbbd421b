"""Load a GGUF file (llama.cpp's format) into a ``ModelConfig``, a Hugging Face state dict and a tokenizer.

Quantised blocks are dequantised here, in vectorised torch, from the block layouts that ggml defines
(``ggml-common.h``): every block stores one or two f16 scales and packed integer codes, and the value of
an element is ``scale * code (+ min)``. The K-quants group 256 elements into a super-block with 6-bit
(Q4_K, Q5_K) or 8-bit (Q6_K) sub-block scales. Operations run in the same order as gguf-py's numpy
reference, so results are bit-identical to it.

GGUF lists tensor dimensions fastest-first (ggml's ``ne``), the reverse of torch's order. llama.cpp's
converter also permutes the rows of ``q_proj``/``k_proj`` of Llama-architecture models so that rotary
embedding pairs are adjacent (GPT-J style); we undo that so the weights use Hugging Face's rotate-half
layout. Qwen2/Qwen3 GGUFs are written unpermuted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from specserve.config import ModelConfig
from specserve.tokenizer import Tokenizer

QK_K = 256  # elements in one K-quant super-block
Q = gguf.GGMLQuantizationType


# --------------------------------------------------------------------------------------------------------
# Dequantisation
# --------------------------------------------------------------------------------------------------------


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian f16 stored as bytes -> float32."""
    # b: [num_blocks, 2] uint8 -> [num_blocks, 1] float32
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Split bytes into (low, high) nibbles: ``[n, g, 32] -> [n, g, 2, 32]`` with low first."""
    # qs: [num_blocks, num_groups, group_bytes] uint8
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [num_blocks, 34] = d (f16) | 32 x int8
    d = _f16(blocks[:, :2])
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return d * q


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [num_blocks, 18] = d (f16) | 16 bytes; element i is the low nibble of byte i, element
    # 16 + i its high nibble; value = d * (q - 8)
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, None, 2:]).reshape(-1, 32).to(torch.int8) - 8
    return d * q.float()


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [num_blocks, 22] = d (f16) | qh (4 bytes, little-endian: bit i is the 5th bit of element i) |
    # 16 bytes of low nibbles as in Q4_0; value = d * (q - 16)
    d = _f16(blocks[:, :2])
    qh = blocks[:, 2:6].to(torch.int64)  # [num_blocks, 4]
    high_bits = ((qh[:, :, None] >> torch.arange(8)) & 1).reshape(-1, 32)  # [num_blocks, 32] bit i of qh
    low = _nibbles(blocks[:, None, 6:]).reshape(-1, 32).to(torch.int64)
    return d * ((low | (high_bits << 4)) - 16).float()


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [num_blocks, 20] = d (f16) | m (f16) | 16 bytes; value = d * q + m
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, None, 4:]).reshape(-1, 32).float()
    return d * q + m


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K and Q5_K into 8 scales and 8 mins per super-block.

    Bytes 0..3 hold scales 0..3 (low 6 bits), bytes 4..7 mins 0..3; scales/mins 4..7 keep their low 4
    bits in bytes 8..11 (scale low nibble, min high nibble) and their top 2 bits in the top 2 bits of
    bytes 0..3 (scales) and 4..7 (mins).
    """
    # scales: [num_blocks, 12] uint8 -> ([num_blocks, 8], [num_blocks, 8]) uint8
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [num_blocks, 144] = d | dmin | 12 scale bytes | 128 code bytes. The codes come in 4 chunks
    # of 32 bytes; chunk c holds sub-block 2c in its low nibbles and 2c+1 in its high nibbles.
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    scale = (d * sc.float()).reshape(n, 8, 1)
    offset = (dmin * mn.float()).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return (scale * q - offset).reshape(n, QK_K)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [num_blocks, 176] = d | dmin | 12 scale bytes | 32 high-bit bytes | 128 low-nibble bytes.
    # Bit j of high-bit byte l is the 5th bit of element l of sub-block j.
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    scale = (d * sc.float()).reshape(n, 8, 1)
    offset = (dmin * mn.float()).reshape(n, 8, 1)
    low = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    high = (blocks[:, None, 16:48] >> shifts) & 0x01  # [n, 8, 32]
    q = (low | (high << 4)).float()
    return (scale * q - offset).reshape(n, QK_K)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # blocks: [num_blocks, 210] = 128 low-nibble bytes | 64 high-2-bit bytes | 16 int8 scales | d.
    # Each half of 128 elements uses 64 low bytes (low nibbles: elements 0..63, high: 64..127) and 32 high
    # bytes (bit pair 2s..2s+1 belongs to the s-th run of 32 elements); value = d * scale[i // 16] * (q - 32).
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = _f16(blocks[:, 208:210])
    low = torch.stack((ql & 0x0F, ql >> 4), dim=2).reshape(n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = (qh >> shifts) & 0x03  # [n, 2, 4, 32]
    q = (low | (high << 4)).to(torch.int8) - 32
    scale = (d * scales).reshape(n, QK_K // 16, 1)
    return (scale * q.reshape(n, QK_K // 16, 16).float()).reshape(n, QK_K)


_BLOCK_DEQUANT = {
    Q.Q8_0: _dequant_q8_0,
    Q.Q4_0: _dequant_q4_0,
    Q.Q5_0: _dequant_q5_0,
    Q.Q4_1: _dequant_q4_1,
    Q.Q4_K: _dequant_q4_k,
    Q.Q5_K: _dequant_q5_k,
    Q.Q6_K: _dequant_q6_k,
}
_FLOAT_DTYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
SUPPORTED_QTYPES = tuple(_FLOAT_DTYPES) + tuple(_BLOCK_DEQUANT)


def dequantize(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: Sequence[int]) -> torch.Tensor:
    """Dequantise GGUF tensor data to float32 in torch order.

    ``raw`` is the tensor's data as stored (the uint8 bytes, or the typed array gguf's reader gives for
    float types); ``shape`` is the torch shape (slowest dimension first, i.e. GGUF's ``ne`` reversed).
    """
    qtype = gguf.GGMLQuantizationType(qtype)
    numel = math.prod(shape)
    # np.array copies out of the read-only memory map, so torch gets a writable buffer it may own
    data = torch.from_numpy(np.array(np.ascontiguousarray(raw).reshape(-1).view(np.uint8)))
    if qtype in _FLOAT_DTYPES:
        out = data.view(_FLOAT_DTYPES[qtype]).float()
    elif qtype in _BLOCK_DEQUANT:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if numel % block_size != 0 or data.numel() != numel // block_size * type_size:
            raise ValueError(f"{qtype.name}: {data.numel()} bytes do not hold a tensor of shape "
                             f"{tuple(shape)}")
        out = _BLOCK_DEQUANT[qtype](data.reshape(-1, type_size))
    else:
        supported = ", ".join(t.name for t in SUPPORTED_QTYPES)
        raise NotImplementedError(f"GGUF tensor type {qtype.name} is not supported (supported: {supported})")
    if out.numel() != numel:
        raise ValueError(f"{qtype.name}: got {out.numel()} elements, expected shape {tuple(shape)}")
    return out.reshape(tuple(shape))


# --------------------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------------------


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value: a scalar, str, or list (string arrays decoded as UTF-8); ``default`` if absent.

    Reads ``parts`` directly: ``ReaderField.contents()`` is ~100x slower on 50k-entry vocabularies.
    """
    f = reader.fields.get(key)
    if f is None:
        return default
    main = gguf.GGUFValueType(f.types[0])
    if main == gguf.GGUFValueType.ARRAY:
        if len(f.types) > 1 and f.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        if not f.data:
            return []
        return np.concatenate([f.parts[i] for i in f.data]).tolist()
    if main == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


def _rope_scaling(reader: gguf.GGUFReader, arch: str, rope_theta: float, head_dim: int) -> dict | None:
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    orig = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    if kind in ("linear", "yarn") and factor is not None and factor != 1.0:
        out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        return out
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        return _llama3_from_rope_freqs(reader, rope_theta, head_dim)
    return None


def _llama3_from_rope_freqs(reader: gguf.GGUFReader, rope_theta: float, head_dim: int) -> dict:
    """llama.cpp stores Llama-3.1 rope scaling as per-frequency factors; recover HF's parameters.

    Only the published Llama-3.x settings (low 1, high 4, original context 8192) are recognised.
    """
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    freqs = dequantize(t.data, t.tensor_type, [int(t.n_elements)])  # [head_dim // 2]
    factor = float(freqs.max())
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    inv = rope_theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    expect = torch.where(wavelen < high_wl, torch.ones_like(wavelen),
                         torch.where(wavelen > low_wl, torch.full_like(wavelen, factor),
                                     1 / ((1 - smooth) / factor + smooth)))
    if not torch.allclose(expect.float(), freqs, rtol=1e-3):
        raise NotImplementedError("rope_freqs.weight does not match Llama-3 rope scaling with the published "
                                  "parameters; this GGUF's rope scaling is not supported")
    return params


def config_from_gguf(reader: gguf.GGUFReader, tokenizer: Tokenizer,
                     default_name: str = "model") -> ModelConfig:
    """Build a ``ModelConfig`` from ``{arch}.*`` metadata (llama, qwen2, qwen3)."""
    arch = field_value(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: llama, qwen2, qwen3)")

    def meta(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    names = {t.name for t in reader.tensors}
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", 0) or hidden // heads)
    rope_theta = float(meta("rope.freq_base", 10000.0))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(field_value(reader, f"{arch}.vocab_size", 0) or int(embd.shape[1]))
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(reader, arch, rope_theta, head_dim),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=list(tokenizer.eos_token_ids),
        name=str(field_value(reader, "general.name", default_name)),
    )


# --------------------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------------------

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_IGNORED = {"rope_freqs.weight"}  # folded into ModelConfig.rope_scaling


def hf_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _IGNORED:
        return None
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> HF rotate-half halves).

    Within each head, llama.cpp stores rows in the order ``[x0, x_h, x1, x_{h+1}, ...]`` (h = head_dim/2);
    HF wants ``[x0, x1, ..., x_{h-1}, x_h, ...]``. Worked example, head_dim 4: rows ``[a0, b0, a1, b1]``
    -> ``[a0, a1, b0, b1]``.
    """
    # weight: [num_heads * head_dim, in_features] (or [num_heads * head_dim] for a bias)
    rows = weight.shape[0]
    head_dim = rows // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32
              ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read a GGUF file (memory-mapped) into ``(config, state_dict with HF names, tokenizer)``."""
    config, state_dict, tokenizer, _ = read_gguf(path, dtype)
    return config, state_dict, tokenizer


@dataclass
class QuantizedTensor:
    """A GGUF tensor kept in its block format: ``raw`` is ``[out_features, row_bytes]`` uint8, rows already in
    Hugging Face order (``row_order[i]`` = the GGUF row now at row i, after the q/k un-permutation)."""

    qtype: str  # "q4_1" | "q8_0"
    raw: np.ndarray
    out_features: int
    in_features: int
    row_order: torch.Tensor | None  # [out_features] int64, None = unchanged


KEEP_QUANTIZED = {gguf.GGMLQuantizationType.Q4_1: "q4_1", gguf.GGMLQuantizationType.Q8_0: "q8_0"}


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32
              ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, dict[str, QuantizedTensor]]:
    """Like ``load_gguf``, and also returns the Q4_1 / Q8_0 matrices in block form for the quantized CPU
    kernels (keyed by HF name; the dequantized copy stays in the state dict as the reference)."""
    reader = gguf.GGUFReader(str(path))
    tokenizer = Tokenizer.from_gguf(reader)
    config = config_from_gguf(reader, tokenizer, default_name=Path(path).stem)
    state_dict: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedTensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        shape = [int(d) for d in reversed(t.shape.tolist())]
        w = dequantize(t.data, t.tensor_type, shape)
        heads = None
        if config.architecture == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            heads = config.num_attention_heads
        elif config.architecture == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            heads = config.num_key_value_heads
        if heads is not None:
            w = unpermute_rope_rows(w, heads)
        state_dict[name] = w.to(dtype)
        if t.tensor_type in KEEP_QUANTIZED and len(shape) == 2:
            order = unpermute_rope_rows(torch.arange(shape[0]), heads) if heads is not None else None
            quantized[name] = QuantizedTensor(KEEP_QUANTIZED[t.tensor_type], np.asarray(t.data).reshape(shape[0], -1),
                                              shape[0], shape[1], order)
    return config, state_dict, tokenizer, quantized
