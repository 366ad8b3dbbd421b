"""Attention for draft-head training: a dense, differentiable stand-in for the paged backend that reproduces
what the head sees at inference.

Two streams per batch of ``B`` sequences padded to ``T``:

- real entries (head entry ``j`` = token ``j + 1`` with the target's features at ``j``, at position ``j``):
  plain causal attention; their keys and values are kept per layer for the chains.
- chains: anchor ``j`` grows slots ``1, 2, ...`` at positions ``j + 1, j + 2, ...`` (the sequential draft steps
  of EAGLE-3's training-time test, arXiv 2503.01840, or P-EAGLE's mask-token slots, arXiv 2602.01469). Slot
  ``s`` of anchor ``j`` attends to the real entries ``0 .. j`` and to slots ``1 .. s`` of its own anchor, exactly
  the keys the head's cache holds when it drafts token ``s + 1`` after position ``j`` at inference.

    T = 4, anchor j = 1, slots 1-2:      keys seen
      slot 1 (position 2)                real 0, real 1, slot 1
      slot 2 (position 3)                real 0, real 1, slot 1, slot 2

Chains attend over ``[real T | chain A * C]`` keys under a boolean mask (``chain_mask``) in one fused
attention call. The head's modules are reused unchanged: this object is passed
as the ``backend`` and each layer's ``kv_cache`` slot carries that layer's ``ChainLayerState``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.layers.attention import sdpa


@dataclass
class ChainLayerState:
    """One head layer's keys/values so far: the real stream and every chain slot computed."""

    k_real: torch.Tensor | None = None  # [B, T, num_kv_heads, head_dim]
    v_real: torch.Tensor | None = None
    k_chain: list[torch.Tensor] = field(default_factory=list)  # each [B, A, S_i, num_kv_heads, head_dim]
    v_chain: list[torch.Tensor] = field(default_factory=list)


@dataclass
class ChainMeta:
    """Layout of the packed tokens of one call: ``num_real = B * T`` real tokens first (or none), then
    ``B * A * num_slots`` chain tokens ordered (sequence, anchor, slot)."""

    batch: int
    seq_len: int  # T
    real: bool  # whether this call carries the real stream
    anchors: torch.Tensor | None = None  # [B, A] int64 anchor position j of each chain
    num_slots: int = 0  # new chain slots per anchor in this call

    @property
    def num_real(self) -> int:
        return self.batch * self.seq_len if self.real else 0


def layer_states(num_layers: int) -> list[tuple[ChainLayerState, None]]:
    """What to pass as the head's ``kv_caches``: one fresh state per layer."""
    return [(ChainLayerState(), None) for _ in range(num_layers)]


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:  # [..., KVH, D] -> [..., KVH * group, D]
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


def chain_mask(
    anchors: torch.Tensor,  # [B, A] int64
    seq_len: int,  # T
    num_query_slots: int,  # S
    num_chain_slots: int,  # C (the last S are the queries' own)
) -> torch.Tensor:  # [B, 1, A * S, T + A * C] bool, True = attend
    """Which keys each chain query sees: real entry ``t`` iff ``t <= anchor``; chain slot ``(a', c)`` iff it is
    the query's own anchor and ``c`` is not after the query's own slot.

        A = 2, S = 1, C = 2 (second TTT step), anchors [0, 1], T = 2:
        query (anchor 0)  real [1 0]  chain a0 [1 1]  a1 [0 0]
        query (anchor 1)  real [1 1]  chain a0 [0 0]  a1 [1 1]
    """
    B, A = anchors.shape
    S, C = num_query_slots, num_chain_slots
    dev = anchors.device
    real = torch.arange(seq_len, device=dev)[None, None, :] <= anchors[:, :, None]  # [B, A, T]
    real = real[:, :, None, :].expand(B, A, S, seq_len).reshape(B, A * S, seq_len)
    own = torch.arange(S, device=dev) + (C - S)
    slot_ok = torch.arange(C, device=dev)[None, :] <= own[:, None]  # [S, C]
    same = torch.eye(A, dtype=torch.bool, device=dev)  # [A, A']
    chain = (same[:, None, :, None] & slot_ok[None, :, None, :]).reshape(A * S, A * C)
    return torch.cat([real, chain[None].expand(B, -1, -1)], dim=-1)[:, None]


def chain_attention(
    q: torch.Tensor,  # [B, A, S, H, D] new chain slots' queries
    k_real: torch.Tensor,  # [B, T, KVH, D]
    v_real: torch.Tensor,  # [B, T, KVH, D]
    k_chain: torch.Tensor,  # [B, A, C, KVH, D] every chain slot so far; the last S are the queries' own
    v_chain: torch.Tensor,  # [B, A, C, KVH, D]
    anchors: torch.Tensor,  # [B, A] int64
    scale: float,
) -> torch.Tensor:  # [B, A, S, H, D]
    """One fused attention (``scaled_dot_product_attention`` with a boolean mask, so no ``[Q, K]`` score tensor
    is kept for backward on GPU) over the keys ``[real T | chain A * C]``."""
    B, A, S, H, D = q.shape
    T, C = k_real.shape[1], k_chain.shape[2]
    group = H // k_real.shape[2]
    keys = torch.cat([_expand_kv(k_real, group), _expand_kv(k_chain, group).reshape(B, A * C, H, D)], dim=1)
    values = torch.cat([_expand_kv(v_real, group), _expand_kv(v_chain, group).reshape(B, A * C, H, D)], dim=1)
    out = sdpa(q.reshape(B, A * S, H, D).transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
               attn_mask=chain_mask(anchors, T, S, C), scale=scale)  # [B, H, A * S, D]
    return out.transpose(1, 2).reshape(B, A, S, H, D)


class ChainAttentionBackend:
    """``AttentionBackend`` for training; ``meta`` is a ``ChainMeta`` and ``k_cache`` a ``ChainLayerState``."""

    def prepare(self, meta, block_size: int) -> None:
        pass

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: ChainLayerState,
        v_cache: None,
        meta: ChainMeta,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        state = k_cache
        B, T, n_real = meta.batch, meta.seq_len, meta.num_real
        H, D = q.shape[1], q.shape[2]
        scale = D ** -0.5
        outs = []
        if meta.real:
            qr = q[:n_real].view(B, T, H, D)
            kr = k[:n_real].reshape(B, T, -1, D)
            vr = v[:n_real].reshape(B, T, -1, D)
            state.k_real, state.v_real = kr, vr
            out = sdpa(qr.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), is_causal=True, scale=scale)
            outs.append(out.transpose(1, 2).reshape(n_real, H, D))
        if meta.num_slots:
            if state.k_real is None:
                raise RuntimeError("chain slots need the real stream of this batch first")
            A, S = meta.anchors.shape[1], meta.num_slots
            qc = q[n_real:].view(B, A, S, H, D)
            kc = k[n_real:].reshape(B, A, S, -1, D)
            vc = v[n_real:].reshape(B, A, S, -1, D)
            state.k_chain.append(kc)
            state.v_chain.append(vc)
            out = chain_attention(qc, state.k_real, state.v_real, torch.cat(state.k_chain, dim=2),
                                  torch.cat(state.v_chain, dim=2), meta.anchors, scale)
            outs.append(out.reshape(B * A * S, H, D))
        return torch.cat(outs) if len(outs) > 1 else outs[0]
