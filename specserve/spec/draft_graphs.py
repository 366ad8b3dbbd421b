"""CUDA graphs for EAGLE-3's sequential draft steps (Li et al., arXiv 2503.01840, drafting as in its section 3).

After the head's ingest forward has given every drafting request its first draft and that draft's feature, the
remaining ``steps = K - 1`` single-token steps are a fixed chain: step ``s`` feeds the previous draft and its
feature to the head at the next position and takes the argmax. Eagerly each step is a few dozen small launches
plus host work; here all ``steps`` run as one static forward over ``bucket`` padded rows, captured once per
(bucket, steps) and replayed, and the drafts come back with one device-to-host copy.

Positions and slots are fixed before the replay: the caller reserves ``steps`` head-cache positions per request
(``DraftKV.reserve``) right after the ingest, so request ``r`` with ``c`` cached head entries writes step ``s``
(1-based) at position ``c + s - 1`` and attends to ``c + s`` keys.

Worked example: block_size 4, steps 2, bucket 2, one request R with c = 10 entries and head block table
[7, 2, 5] (positions 10 and 11 lie in block 5 -> slots 5*4 + 2 = 22 and 23):

    staging = [ids: d1 0 | positions: s1 [10 0] s2 [11 0] | slots: s1 [22 -1] s2 [23 -1]
               | seq_lens: s1 [11 1] s2 [12 1] | tables: [7 2 5 0 ..] [0 0 0 0 ..]]
    features[0] = f1 (the first draft's feature), features[1] = 0 (padding row)
    replay -> drafts[0] = [d2 x], drafts[1] = [d3 x]      (x: the padding row's, dropped)

Padding rows write no KV (slot -1) and attend to one key. A request that asked for fewer drafts than the chain
runs still gets the longer chain: its extra drafts are dropped, and the caller's ``truncate`` rolls back their
positions as it does for every draft. With ``capture=False`` the same static forward runs eagerly (any device,
any backend with ``prepare_static``): the CPU tests check it against the eager loop draft for draft.
"""

from __future__ import annotations

import time

import torch

from specserve.engine.cuda_graphs import StagingBuffer, bucket_for, bucket_sizes, capture_graph
from specserve.layers.attention import AttentionMetadata


class ChainGraphRunner:
    """Static (captured when ``capture``) chains of single-token head steps over ``DraftKV``'s cache."""

    def __init__(self, head, kv, batch_sizes: tuple[int, ...], max_num_seqs: int, max_steps: int,
                 max_positions: int, device: torch.device, capture: bool, pool=None) -> None:
        backend = kv.backend
        if capture and not getattr(backend, "capturable", False):
            raise ValueError(f"{type(backend).__name__} cannot be captured in a CUDA graph")
        if not hasattr(backend, "prepare_static"):
            raise ValueError(f"{type(backend).__name__} has no prepare_static()")
        self.head, self.kv, self.backend, self.device, self.capture = head, kv, backend, device, capture
        self.block_size = kv.block_size
        self.buckets = bucket_sizes(batch_sizes, max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.max_steps = max_steps
        self.width = -(-max_positions // self.block_size)  # block-table columns of every graph
        c = head.config.layer
        self.num_kv_heads = c.num_key_value_heads
        dtype = next(head.parameters()).dtype
        b, k = self.max_batch, max_steps
        self._staging = StagingBuffer(b + 3 * k * b + b * self.width, device)
        self.staging = self._staging.device
        with torch.inference_mode():
            self.block_tables = torch.zeros((b, self.width), dtype=torch.int64, device=device)
            self.features = torch.zeros((b, c.hidden_size), dtype=dtype, device=device)
            self.drafts = torch.zeros((k, b), dtype=torch.int64, device=device)
            self.query_start_loc = torch.arange(b + 1, dtype=torch.int64, device=device)  # one token per row
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        self.forwards: dict[tuple[int, int], object] = {}
        # graphs of one engine share a pool (they never replay at the same time): the target's, when given
        self.pool = (pool or torch.cuda.graph_pool_handle()) if capture else None
        self.capture_seconds = 0.0
        self.num_replays = 0

    def fits(self, num_rows: int, steps: int, longest: int) -> bool:
        """``num_rows`` requests, ``steps`` chain steps, the longest request ending at ``longest`` positions."""
        return (1 <= steps <= self.max_steps and 1 <= num_rows <= self.max_batch
                and longest <= self.width * self.block_size)

    # ---- static buffers ------------------------------------------------------------------------
    def _views(self, bucket: int, steps: int):
        """(ids [B], positions [S, B], slots [S, B], seq_lens [S, B], tables [B, w]) views of ``staging``."""
        s, b, sb = self.staging, bucket, steps * bucket
        return (s[:b], s[b:b + sb].view(steps, b), s[b + sb:b + 2 * sb].view(steps, b),
                s[b + 2 * sb:b + 3 * sb].view(steps, b), s[b + 3 * sb:b + 3 * sb + b * self.width].view(b, self.width))

    def _values(self, first_ids: list[int], computed: list[int], tables: list[list[int]], bucket: int,
                steps: int) -> list[int]:
        """The staging values (layout of ``_views``; padding rows: token 0, position 0, slot -1, one key)."""
        bs, pad = self.block_size, bucket - len(first_ids)
        ids = list(first_ids) + [0] * pad
        pos, slots, lens = [], [], []
        for s in range(1, steps + 1):
            for c, table in zip(computed, tables):
                p = c + s - 1
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
                lens.append(c + s)
            pos += [0] * pad
            slots += [-1] * pad
            lens += [1] * pad
        flat = []
        for table in tables:
            row = table[:self.width]
            flat += row + [0] * (self.width - len(row))
        flat += [0] * (pad * self.width)
        return ids + pos + slots + lens + flat

    def _load(self, values: list[int], bucket: int, steps: int) -> None:
        self._staging.load(values)
        self.block_tables[:bucket].copy_(self._views(bucket, steps)[4])

    # ---- build / capture -----------------------------------------------------------------------
    def _forward_for(self, bucket: int, steps: int):
        ids0, pos, slots, lens, _ = self._views(bucket, steps)
        tables = self.block_tables[:bucket]  # [B, width]
        choose = getattr(self.backend, "graph_num_splits", None)
        num_splits = choose(bucket, self.num_kv_heads, self.device) if choose is not None else None
        metas = [AttentionMetadata(num_tokens=bucket, query_lens=[1] * bucket, seq_lens=[], slot_mapping=slots[s],
                                   block_tables=tables, query_start_loc=self.query_start_loc[:bucket + 1])
                 for s in range(steps)]
        head, kv, backend, block_size = self.head, self.kv, self.backend, self.block_size
        features, drafts = self.features, self.drafts

        def forward() -> None:
            ids, fed = ids0, features[:bucket]
            for s, meta in enumerate(metas):
                backend.prepare_static(meta, block_size, lens[s].to(torch.int32), 1, num_splits)
                normed, fed = head(ids, fed, pos[s], kv.kv_caches, meta, backend)
                ids = head.draft_token_ids(normed)  # [B]
                drafts[s, :bucket].copy_(ids)

        return forward

    def _step(self, bucket: int, steps: int):
        key = (bucket, steps)
        if key not in self.forwards:
            self.forwards[key] = forward = self._forward_for(bucket, steps)
            self.graphs[key] = None
            if self.capture:
                self._load(self._values([], [], [], bucket, steps), bucket, steps)  # all padding: no KV writes
                self.features[:bucket].zero_()
                start = time.perf_counter()
                self.graphs[key] = capture_graph(forward, self.pool, self.device)
                self.capture_seconds += time.perf_counter() - start
        return self.forwards[key], self.graphs[key]

    # ---- run -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self,
        first_ids: list[int],  # [num_rows] each request's first draft
        features: torch.Tensor,  # [num_rows, hidden_size] that draft's feature (the head's fed-forward output)
        computed: list[int],  # [num_rows] head entries cached before the chain (its first position)
        tables: list[list[int]],  # [num_rows][blocks] head block tables, ``steps`` positions reserved
        steps: int,
    ) -> list[list[int]]:  # [num_rows][steps] drafts 2 .. steps + 1
        n = len(first_ids)
        bucket = bucket_for(self.buckets, n)
        assert bucket is not None and self.fits(n, steps, max(computed) + steps), "chain does not fit"
        forward, graph = self._step(bucket, steps)  # may capture: before this chain's values load
        self._load(self._values(first_ids, computed, tables, bucket, steps), bucket, steps)
        self.features[:n].copy_(features)
        if n < bucket:
            self.features[n:bucket].zero_()
        if graph is not None:
            graph.replay()
            self.num_replays += 1
        else:
            forward()
        return self.drafts[:steps, :n].t().tolist()
