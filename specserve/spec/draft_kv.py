"""The paged KV cache a model-based drafter (draft model, EAGLE-3 head, P-EAGLE head) keeps of its own.

The drafter's cache follows the target's requests: ``num_computed[request_id]`` of a request's positions
have drafter KV. A drafting round appends speculative positions on top and ``truncate`` drops them again
afterwards, so only positions the target has verified persist between steps:

    target verified positions 0..9  ->  drafter ingests up to 9, drafts at 10, 11, 12 (KV written at 10, 11)
    truncate(rid, 10)               ->  slots 10, 11 rolled back; next step re-ingests from 10 with real tokens
"""

from __future__ import annotations

import torch

from specserve.engine.block_manager import BlockManager
from specserve.engine.model_runner import allocate_kv_caches, default_backend
from specserve.layers.attention import AttentionMetadata, build_attention_metadata


class DraftKV:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.blocks = BlockManager(num_blocks, block_size)
        self.kv_caches = allocate_kv_caches(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        self.backend = default_backend(device, dtype)
        self.num_computed: dict[str, int] = {}

    def computed(self, request_id: str) -> int:
        return self.num_computed.get(request_id, 0)

    def metadata(
        self,
        request_ids: list[str],  # [num_seqs]
        query_lens: list[int],  # [num_seqs] new positions each sequence appends after its computed ones
    ) -> AttentionMetadata:
        """Reserve slots for the new positions and describe the ragged batch; advances ``num_computed``."""
        seq_lens = []
        for rid, q_len in zip(request_ids, query_lens):
            self.blocks.allocate(rid, q_len)
            self.num_computed[rid] = self.computed(rid) + q_len
            seq_lens.append(self.num_computed[rid])
        tables = [self.blocks.block_table(rid) for rid in request_ids]
        meta = build_attention_metadata(query_lens, seq_lens, tables, self.block_size, self.device)
        self.backend.prepare(meta, self.block_size)
        return meta

    def reserve(self, request_ids: list[str], num_positions: int) -> tuple[list[int], list[list[int]]]:
        """Allocate ``num_positions`` more positions per request without building step metadata (a static chain
        of steps describes them itself, ``spec/draft_graphs.py``). Returns (positions cached before, block tables
        after)."""
        before = []
        for rid in request_ids:
            before.append(self.computed(rid))
            self.blocks.allocate(rid, num_positions)
            self.num_computed[rid] = before[-1] + num_positions
        return before, [self.blocks.block_table(rid) for rid in request_ids]

    def truncate(self, request_id: str, num_positions: int) -> None:
        """Keep the first ``num_positions`` positions of a request, drop the rest."""
        have = self.computed(request_id)
        if num_positions < have:
            self.blocks.rollback(request_id, have - num_positions)
            self.num_computed[request_id] = num_positions

    def free(self, request_id: str) -> None:
        self.blocks.free(request_id)
        self.num_computed.pop(request_id, None)
