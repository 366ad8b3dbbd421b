"""Rotate-half rotary position embedding (RoPE; Su et al., RoFormer, arXiv 2104.09864) as Triton helpers, shared
by the standalone rope kernel (``triton_ops._rope_kernel``) and the attention backend's fused rope + KV-cache write
(``triton_attention._rope_write_kv_kernel``), so both round exactly as the torch reference ``TorchOps.rope_`` does.

A head of ``head_dim`` values is two halves ``x = [x1 | x2]``; with the token's ``cos = [c1 | c2]`` and
``sin = [s1 | s2]`` (``layers/rope.py``, the two halves of each equal for Llama's tables but not assumed equal):

    out1 = x1 * c1 - x2 * s1,    out2 = x2 * c2 + x1 * s2

torch computes ``x * cos + cat(-x2, x1) * sin`` in the activation dtype: each product is rounded to it before the
sum. The helpers do the same (products in fp32, rounded to the activation dtype, summed in fp32, rounded), and the
kernels that use them are launched with ``enable_fp_fusion=False`` so that no product is fused into an FMA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROPE_TILE = 2048  # rotated elements per program: heads are split into blocks of ROPE_TILE // head_dim


def rope_tables_match(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim] the heads to rotate
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim]
) -> bool:
    """Whether the helpers rotate ``x`` as ``TorchOps.rope_`` would: an even head_dim, and cos/sin of x's dtype
    (torch promotes bf16 x times fp32 cos to fp32 before rounding: other bits) with contiguous rows."""
    num_tokens, _, head_dim = x.shape
    return head_dim % 2 == 0 and all(t.dtype == x.dtype and t.shape == (num_tokens, 1, head_dim)
                                     and t.stride(-1) == 1 for t in (cos, sin))


def rope_block_heads(num_heads: int, head_dim: int) -> tuple[int, int]:
    """(HALF_PAD, BLOCK_H) of a rope launch: the padded half head, and heads per program (about ROPE_TILE
    elements, a power of two, no more than the heads there are)."""
    half_pad = triton.next_power_of_2(head_dim // 2)
    return half_pad, min(triton.next_power_of_2(num_heads), max(1, ROPE_TILE // (2 * half_pad)))


@triton.jit
def rope_cos_sin(
    cos_row_ptr,  # [head_dim] one token's cos, contiguous
    sin_row_ptr,  # [head_dim] one token's sin, contiguous
    HALF: tl.constexpr,  # head_dim // 2
    HALF_PAD: tl.constexpr,  # next power of two >= HALF
):  # (cos1, cos2, sin1, sin2), each [1, HALF_PAD] fp32: the halves of one token's cos and sin, 0 past HALF
    dims = tl.arange(0, HALF_PAD)
    m = dims < HALF
    c1 = tl.load(cos_row_ptr + dims, mask=m, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row_ptr + HALF + dims, mask=m, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row_ptr + dims, mask=m, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row_ptr + HALF + dims, mask=m, other=0.0).to(tl.float32)[None, :]
    return c1, c2, s1, s2


@triton.jit
def rope_rotate(
    x1,  # [heads, HALF_PAD] first halves of the heads, activation dtype
    x2,  # [heads, HALF_PAD] second halves
    cs,  # rope_cos_sin(...) of the heads' token
):  # (out1, out2) in x1's dtype: rotate-half RoPE with torch's roundings (launch with enable_fp_fusion=False)
    c1, c2, s1, s2 = cs
    act = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    out1 = (x1f * c1).to(act).to(tl.float32) - (x2f * s1).to(act).to(tl.float32)
    out2 = (x2f * c2).to(act).to(tl.float32) + (x1f * s2).to(act).to(tl.float32)
    return out1.to(act), out2.to(act)


@triton.jit
def rope_rotate_(
    ptr1,  # [heads, HALF_PAD] pointers to the heads' first halves (second halves at + HALF); rotated in place
    mask,  # [heads, HALF_PAD] elements to rotate
    cs,  # rope_cos_sin(...) of the heads' token
    HALF: tl.constexpr,  # head_dim // 2
):  # (out1, out2): the rotated halves, as stored
    out1, out2 = rope_rotate(tl.load(ptr1, mask=mask, other=0.0), tl.load(ptr1 + HALF, mask=mask, other=0.0), cs)
    tl.store(ptr1, out1, mask=mask)
    tl.store(ptr1 + HALF, out2, mask=mask)
    return out1, out2
