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

Ingest graphs (``run_ingest``). The head's ingest forward before the chain (each request's queued entries: its
verified tokens with the target's features, 1 to k + 1 of them in steady decoding) is just as static once padded:
rows of ``q`` entries per request (``q`` the longest queue rounded up to a power of two; a shorter queue gets padding
entries after its own, slot -1, and a seq_len grown by as many, so its real entries keep their positions and
causality hides the padding, as in the target's padded steps, ``engine/cuda_graphs.py``), then each request's last
real row gives the first draft and its feature, and the chain follows in the same graph: one replay and one
device-to-host copy per drafting step, captured per (bucket, q, steps). Eagerly the ingest alone is ~1 ms of host
work on an H200's host (``benchmarks/results/spec_step_profile_gpu.json``) for ~0.1 ms of device work.

Padding rows write no KV (slot -1) and attend to one key. A request that asked for fewer drafts than the chain
runs still gets the longer chain: its extra drafts are dropped, and the caller's ``truncate`` rolls back their
positions as it does for every draft. With ``capture=False`` the same static forward runs eagerly (any device,
any backend with ``prepare_static``): the CPU tests check it against the eager loop draft for draft.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from specserve.engine.cuda_graphs import StagingBuffer, bucket_for, bucket_sizes, capture_graph
from specserve.layers.attention import MAX_PADDED_QUERY_LEN, AttentionMetadata

# Longest queue of head entries per request an ingest graph takes: k + 1 in steady decoding, up to the engine's
# LAZY_DRAFT_STEPS + 1 in the catch-up after the adaptive policy's cap-0 steps; longer ones (a prefill chunk)
# ingest eagerly. Bounds the static feature buffer: [largest bucket x this, n_aux x target hidden] (Llama-3.1-8B
# at 256 sequences: 100 MB in bf16).
INGEST_MAX_ENTRIES = 16
# Most ingest passes of INGEST_MAX_ENTRIES entries one catch-up graph runs (``run_catch_up``), where the batch
# leaves room in those buffers: a drafter may then sit out 4 x 16 - 1 steps of cap 0 between catch-ups.
CATCH_UP_MAX_CHUNKS = 4


def _ingest_sizes(bucket: int, q: int, steps: int, chunks: int) -> tuple[int, ...]:
    """Lengths of the ingest staging's parts, in order (``ChainGraphRunner._ingest_views``), T = chunks x bucket
    x q: ids, positions, slots [T]; seq_lens [chunks x B]; last rows [B]; chain positions, slots, seq_lens
    [S x B]; real-row index [T]. The block tables follow at their sum."""
    t, sb = chunks * bucket * q, steps * bucket
    return t, t, t, chunks * bucket, bucket, sb, sb, sb, t


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
        # ingest graphs: queues of up to max_ingest entries per request (INGEST_MAX_ENTRIES)
        self.max_ingest = min(MAX_PADDED_QUERY_LEN, INGEST_MAX_ENTRIES)
        q = self.max_ingest
        self._ingest_staging = StagingBuffer(4 * b * q + 2 * b + 3 * k * b + b * self.width, device)
        with torch.inference_mode():
            self.block_tables = torch.zeros((b, self.width), dtype=torch.int64, device=device)
            self.features = torch.zeros((b, c.hidden_size), dtype=dtype, device=device)
            self.drafts = torch.zeros((k, b), dtype=torch.int64, device=device)
            self.query_start_loc = torch.arange(b + 1, dtype=torch.int64, device=device)  # one token per row
            self.ingest_features = torch.zeros((b * q, head.config.fc_in_features), dtype=dtype, device=device)
            self.ingest_drafts = torch.zeros((1 + k, b), dtype=torch.int64, device=device)
            # query_start_loc of ingest rows of q entries, per q: [b + 1] each
            self.ingest_starts = [torch.arange(b + 1, dtype=torch.int64, device=device) * n for n in range(q + 1)]
        self.graphs: dict[tuple[int, ...], torch.cuda.CUDAGraph | None] = {}  # (bucket, steps) / (bucket, q, steps)
        self.forwards: dict[tuple[int, ...], object] = {}
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
        """(ids [B], positions [S, B], slots [S, B], seq_lens [S, B]) views of ``staging``; the block tables
        follow them there (``_load``)."""
        return self._chain_parts(self.staging, bucket, steps)

    @staticmethod
    def _chain_parts(flat, bucket: int, steps: int):
        """``_views``' layout over ``flat`` (the device buffer, or the host view being filled): ids [B], then
        positions, slots, seq_lens [S, B] each; the block tables start at ``bucket * (1 + 3 * steps)``."""
        b, sb = bucket, steps * bucket
        return flat[:b], *(flat[b + i * sb:b + (i + 1) * sb].reshape(steps, b) for i in range(3))

    def _table_width(self, longest: int) -> int:
        """Block-table columns a step whose longest row sees ``longest`` keys reads (the rest of the fixed-width
        buffer is stale and never read)."""
        return max(1, min(self.width, -(-longest // self.block_size)))

    def _fill_tables(
        self,
        out: np.ndarray,  # [bucket, w] int64 host view
        tables: list[list[int]],  # [num_rows][blocks]
    ) -> np.ndarray:  # [num_rows, w] the real rows
        """Block tables into ``out``, zeros past a table's end and in padding rows."""
        out[:] = 0
        w = out.shape[1]
        for r, table in enumerate(tables):
            row = table[:w]
            out[r, :len(row)] = row
        return out[:len(tables)]

    def _fill_chain(
        self,
        pos: np.ndarray,  # [steps, bucket] int64 host views, written
        slots: np.ndarray,
        lens: np.ndarray,
        starts: np.ndarray,  # [num_rows] int64: each request's first chain position
        tabs: np.ndarray,  # [num_rows, w] its block table
    ) -> None:
        """Chain step s (1-based) of request r writes position ``starts[r] + s - 1`` and sees ``starts[r] + s``
        keys; padding rows: position 0, slot -1, one key."""
        n, bs = len(starts), self.block_size
        p = starts[None, :] + np.arange(pos.shape[0])[:, None]  # [S, n]
        pos[:, :n], pos[:, n:] = p, 0
        blocks = np.take_along_axis(tabs, (p // bs).T, axis=1).T  # [S, n]
        slots[:, :n], slots[:, n:] = blocks * bs + p % bs, -1
        lens[:, :n], lens[:, n:] = p + 1, 1

    def _load(self, first_ids: list[int], computed: list[int], tables: list[list[int]], bucket: int,
              steps: int) -> None:
        """Stage a chain (layout of ``_views``, then the block tables, ``w`` columns) with one host-to-device copy
        and move the tables into ``block_tables``. Padding rows: token 0, position 0, slot -1, one key."""
        b, n = bucket, len(first_ids)
        c = np.asarray(computed, dtype=np.int64)
        w = self._table_width(int(c.max(initial=0)) + steps)
        fixed = b * (1 + 3 * steps)
        host = self._staging.host_view(fixed + b * w)
        ids, *chain = self._chain_parts(host, b, steps)
        ids[:n], ids[n:] = first_ids, 0
        tabs = self._fill_tables(host[fixed:].reshape(b, w), tables)
        self._fill_chain(*chain, c, tabs)
        self._staging.send(fixed + b * w)
        self.block_tables[:b, :w].copy_(self.staging[fixed:fixed + b * w].view(b, w))

    # ---- build / capture -----------------------------------------------------------------------
    def _num_splits(self, bucket: int) -> int | None:
        choose = getattr(self.backend, "graph_num_splits", None)
        return choose(bucket, self.num_kv_heads, self.device) if choose is not None else None

    def _chain_metas(
        self,
        bucket: int,
        slots: torch.Tensor,  # [steps, bucket] int64 static view of the staging: each step's KV slots
        steps: int,
    ) -> list[AttentionMetadata]:
        """One single-token step's metadata per chain step, over the fixed block-table buffer."""
        return [AttentionMetadata(num_tokens=bucket, query_lens=[1] * bucket, seq_lens=[], slot_mapping=slots[s],
                                  block_tables=self.block_tables[:bucket],
                                  query_start_loc=self.query_start_loc[:bucket + 1])
                for s in range(steps)]

    def _run_chain(
        self,
        ids: torch.Tensor,  # [bucket] int64 the drafts fed to the first chain step
        fed: torch.Tensor,  # [bucket, hidden_size] their features
        metas: list[AttentionMetadata],  # one per chain step (``_chain_metas``)
        pos: torch.Tensor,  # [steps, bucket] int64 static views: each step's positions
        lens: torch.Tensor,  # [steps, bucket] int64 static views: each step's seq_lens
        drafts: torch.Tensor,  # [steps, >= bucket] int64: row s gets step s's drafts
        num_splits: int | None,
    ) -> None:
        """The chain's single-token head steps, inside a static forward."""
        bucket = ids.shape[0]
        for s, meta in enumerate(metas):
            self.backend.prepare_static(meta, self.block_size, lens[s].to(torch.int32), 1, num_splits)
            normed, fed = self.head(ids, fed, pos[s], self.kv.kv_caches, meta, self.backend)
            ids = self.head.draft_token_ids(normed)  # [B]
            drafts[s, :bucket].copy_(ids)

    def _forward_for(self, bucket: int, steps: int):
        ids0, pos, slots, lens = self._views(bucket, steps)
        num_splits = self._num_splits(bucket)
        metas = self._chain_metas(bucket, slots, steps)
        features, drafts = self.features, self.drafts

        def forward() -> None:
            self._run_chain(ids0, features[:bucket], metas, pos, lens, drafts, num_splits)

        return forward

    def _built(self, key: tuple[int, ...], make_forward, load_padding) -> tuple:
        """(forward, graph or None) of ``key``, built on first use: ``make_forward()`` gives the static forward;
        with capture, ``load_padding()`` first stages an all-padding step (no KV writes) to record it over."""
        if key not in self.forwards:
            self.forwards[key] = forward = make_forward()
            self.graphs[key] = None
            if self.capture:
                load_padding()
                start = time.perf_counter()
                self.graphs[key] = capture_graph(forward, self.pool, self.device)
                self.capture_seconds += time.perf_counter() - start
        return self.forwards[key], self.graphs[key]

    def _step(self, bucket: int, steps: int):
        def load_padding() -> None:
            self._load([], [], [], bucket, steps)
            self.features[:bucket].zero_()
        return self._built((bucket, steps), lambda: self._forward_for(bucket, steps), load_padding)

    @torch.inference_mode()
    def build(self, batch_sizes: list[int], steps: list[int]) -> None:
        """Build (with capture: capture) now the ingest graphs of every padded queue length for these batch sizes'
        buckets and chain lengths (0: ingest only, the catch-up after cap-0 steps, with its graphs of several
        passes), and the chain-only graphs of those of ``steps`` >= 1; a first use inside a step would capture
        there (a warm-up, e.g. a benchmark's)."""
        qs = sorted({self._ingest_len([n]) for n in range(1, self.max_ingest + 1)})
        for bucket in sorted({bucket_for(self.buckets, b) for b in batch_sizes} - {None}, reverse=True):
            for n in steps:
                if 0 <= n <= self.max_steps:
                    for q in qs:
                        self._ingest_step(bucket, q, n)
                if n == 0:
                    for chunks in range(2, self.catch_up_chunks(bucket) + 1):
                        self._ingest_step(bucket, self.max_ingest, 0, chunks)
                if 1 <= n <= self.max_steps:
                    self._step(bucket, n)

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
        self._load(first_ids, computed, tables, bucket, steps)
        self.features[:n].copy_(features)
        if n < bucket:
            self.features[n:bucket].zero_()
        if graph is not None:
            graph.replay()
            self.num_replays += 1
        else:
            forward()
        return self.drafts[:steps, :n].t().tolist()

    # ---- ingest + chain in one graph -----------------------------------------------------------
    def fits_ingest(self, query_lens: list[int], steps: int, longest: int) -> bool:
        """Requests queueing ``query_lens`` entries each, ``steps`` chain steps after the ingest, the longest
        request (its queue padded to the longest and chain included) ending at ``longest`` positions; every queue
        is padded further to ``_ingest_len`` entries (``run_ingest``), which must fit too."""
        return (bool(query_lens) and 0 <= steps <= self.max_steps and len(query_lens) <= self.max_batch
                and 1 <= min(query_lens) and max(query_lens) <= self.max_ingest
                and longest - max(query_lens) + self._ingest_len(query_lens) <= self.width * self.block_size)

    def _ingest_len(self, query_lens: list[int]) -> int:
        """The padded queue length of an ingest graph: the longest queue rounded up to a power of two (at most
        ``max_ingest``), so that one graph per (bucket, 1 / 2 / 4 / 8 / 16, steps) serves every queue length. Queue
        lengths vary (1 + accepted drafts; the steps a drafter sat out at the adaptive policy's cap 0), and a
        graph per length, captured on first use, cost the adaptive policy's H200 runs of stop 27 many captures;
        a one-layer head's padding rows (at most as many as real ones) cost little. Examples (max_ingest 16):
        [1, 1] -> 1, [3, 1] -> 4, [5] -> 8, [16, 9] -> 16."""
        return min(1 << (max(query_lens) - 1).bit_length(), self.max_ingest)

    def catch_up_chunks(self, num_rows: int) -> int:
        """How many ingest passes of ``max_ingest`` entries per request one catch-up graph of ``num_rows``
        requests holds (``run_catch_up``): as many as the static buffers, sized for the largest bucket's single
        pass, take at this bucket, at most CATCH_UP_MAX_CHUNKS; 0 when no bucket holds the batch. Example,
        buckets up to 64: 8 requests (bucket 8) -> 4 passes (64 entries each), 40 (bucket 64) -> 1."""
        bucket = bucket_for(self.buckets, num_rows)
        return 0 if bucket is None else max(1, min(CATCH_UP_MAX_CHUNKS, self.max_batch // bucket))

    def fits_catch_up(self, query_lens: list[int], computed: list[int]) -> bool:
        """Queues of ``query_lens`` entries (each >= 1) after ``computed`` cached ones fit one catch-up."""
        if not query_lens:
            return False
        chunks = self.catch_up_chunks(len(query_lens))
        if not chunks or not 1 <= min(query_lens) <= max(query_lens) <= chunks * self.max_ingest:
            return False
        q, passes = self._catch_up_shape(max(query_lens))
        return max(computed) + q * passes <= self.width * self.block_size

    def _catch_up_shape(self, most: int) -> tuple[int, int]:
        """(q, chunks) of the catch-up graph for a longest queue of ``most`` entries: one pass of the ingest
        graph's padded length up to ``max_ingest`` entries, else passes of ``max_ingest``."""
        if most <= self.max_ingest:
            return self._ingest_len([most]), 1
        return self.max_ingest, -(-most // self.max_ingest)

    def _ingest_views(self, bucket: int, q: int, steps: int, chunks: int = 1):
        """Device views of the ingest staging, T = chunks x bucket x q rows: ids, positions, slots [T]; seq_lens
        [chunks, B]; last rows [B]; chain positions, slots, seq_lens [S, B]; real-row index [T] (its first
        entries used); then the block tables (``_stage_ingest``)."""
        return self._ingest_parts(self._ingest_staging.device, bucket, q, steps, chunks)

    @staticmethod
    def _ingest_parts(flat, bucket: int, q: int, steps: int, chunks: int):
        """``_ingest_views``' layout over ``flat`` (the device buffer, or the host view being filled)."""
        b = bucket
        parts, at = [], 0
        for size in _ingest_sizes(bucket, q, steps, chunks):
            parts.append(flat[at:at + size])
            at += size
        ids, pos, slots, lens, last, cpos, cslots, clens, index = parts
        return (ids, pos, slots, lens.reshape(chunks, b), last, cpos.reshape(steps, b), cslots.reshape(steps, b),
                clens.reshape(steps, b), index)

    def _stage_ingest(self, input_ids: list[int], query_lens: list[int], computed: list[int],
                      tables: list[list[int]], bucket: int, q: int, steps: int, chunks: int = 1) -> int:
        """Stage an ingest (layout of ``_ingest_views``, then the block tables) with numpy into the pinned host
        buffer, one host-to-device copy, tables into ``block_tables``; returns the real rows' count.

        Request r with c cached entries and n queued (e = chunks x q padded entries each): its entry i sits in
        pass i // q, row (i // q) x B x q + r x q + i % q, at position c + i; entries n .. e - 1 are padding (token 0,
        slot -1); in pass j its seq_len is c + (j + 1) x q; its last real row is that of entry n - 1; chain step s
        writes position c + n + s - 1 and sees c + n + s keys. Padding requests: token 0, positions 0 .. e - 1,
        slot -1, seq_len (j + 1) x q, last row r x q, one key per chain step. Worked example, block_size 4, q 2,
        steps 1, one pass: one request with c = 9, n = 1, table [3, 6, 8]: ids [t, 0], positions [9, 10], slots
        [8*4 + 1, -1], seq_len 11, last 0, chain position 10, slot 8*4 + 2, seq_len 11. Two passes (q 2, bucket 1)
        of n = 3 entries from c = 9: rows [e0 e1 | e2 pad], positions [9 10 | 11 12], seq_lens [11 | 13]."""
        bs, b, e, n = self.block_size, bucket, chunks * q, len(query_lens)
        ql = np.asarray(query_lens, dtype=np.int64)
        c = np.asarray(computed, dtype=np.int64)
        w = self._table_width(int(c.max(initial=0)) + e + steps)
        fixed = sum(_ingest_sizes(b, q, steps, chunks))
        host = self._ingest_staging.host_view(fixed + b * w)
        ids, pos, slots, lens, last, cpos, cslots, clens, index = self._ingest_parts(host, b, q, steps, chunks)
        tabs = self._fill_tables(host[fixed:].reshape(b, w), tables)
        entry = np.arange(e)
        real = entry[None, :] < ql[:, None]  # [n, e]
        grid = np.zeros((b, e), dtype=np.int64)  # per request and entry, then laid out pass by pass
        grid[:n][real] = input_ids

        def lay(out: np.ndarray, values: np.ndarray) -> None:  # [b, e] -> passes of [b, q]
            out.reshape(chunks, b, q)[:] = values.reshape(b, chunks, q).transpose(1, 0, 2)
        lay(ids, grid)
        grid[:n] = c[:, None] + entry
        grid[n:] = entry
        lay(pos, grid)
        p = grid[:n]
        grid[:n] = np.where(real, np.take_along_axis(tabs, p // bs, axis=1) * bs + p % bs, -1)
        grid[n:] = -1
        lay(slots, grid)
        passes = (np.arange(1, chunks + 1) * q)[:, None]  # [chunks, 1]
        lens[:, :n], lens[:, n:] = c[None, :] + passes, passes
        rows = (entry // q) * (b * q) + entry % q  # [e] row of entry i of request 0
        at = rows[None, :] + (np.arange(n) * q)[:, None]  # [n, e]
        last[:n] = at[np.arange(n), ql - 1] if n else 0
        last[n:] = np.arange(n, b) * q
        num_real = int(ql.sum())
        index[:num_real] = at[real]
        self._fill_chain(cpos, cslots, clens, c + ql, tabs)
        self._ingest_staging.send(fixed + b * w)
        self.block_tables[:b, :w].copy_(self._ingest_staging.device[fixed:fixed + b * w].view(b, w))
        return num_real

    def _ingest_forward_for(self, bucket: int, q: int, steps: int, chunks: int = 1):
        """The static ingest forward: ``chunks`` passes of q entries per request (the KV of pass j is written
        before pass j + 1 reads it), then, in a single pass graph, the first drafts and ``steps`` chain steps
        (a catch-up of several passes drafts nothing)."""
        ids, pos, slots, lens, last, cpos, cslots, clens, _ = self._ingest_views(bucket, q, steps, chunks)
        tables = self.block_tables[:bucket]  # [B, width]
        t = bucket * q
        num_splits = self._num_splits(bucket)
        metas = [AttentionMetadata(num_tokens=t, query_lens=[q] * bucket, seq_lens=[],
                                   slot_mapping=slots[j * t:(j + 1) * t], block_tables=tables,
                                   query_start_loc=self.ingest_starts[q][:bucket + 1]) for j in range(chunks)]
        chain_metas = self._chain_metas(bucket, cslots, steps)
        head, kv, backend, block_size = self.head, self.kv, self.backend, self.block_size
        features, drafts = self.ingest_features, self.ingest_drafts

        def forward() -> None:
            for j, meta in enumerate(metas):
                backend.prepare_static(meta, block_size, lens[j].to(torch.int32), q, num_splits)
                hidden = head.fuse(features[j * t:(j + 1) * t])  # [B*q, hidden]
                normed, fed = head(ids[j * t:(j + 1) * t], hidden, pos[j * t:(j + 1) * t], kv.kv_caches, meta,
                                   backend)
            if chunks > 1:
                return
            fed = fed.index_select(0, last)  # [B, hidden]: each request's last real entry
            nxt = head.draft_token_ids(normed.index_select(0, last))  # [B] first drafts
            drafts[0, :bucket].copy_(nxt)
            self._run_chain(nxt, fed, chain_metas, cpos, clens, drafts[1:], num_splits)

        return forward

    def _ingest_step(self, bucket: int, q: int, steps: int, chunks: int = 1):
        def load_padding() -> None:
            self._stage_ingest([], [], [], [], bucket, q, steps, chunks)
            self.ingest_features[:chunks * bucket * q].zero_()
        key = (bucket, q, steps) if chunks == 1 else (bucket, q, steps, chunks)
        return self._built(key, lambda: self._ingest_forward_for(bucket, q, steps, chunks), load_padding)

    def _place_features(
        self,
        features: torch.Tensor,  # [num_real, fc_in_features] packed, request by request
        num_rows: int,  # rows of the graph (padding included)
        num_real: int,
        index: torch.Tensor,  # [>= num_real] int64 device: each real row's padded place (staged)
    ) -> None:
        """Real rows to their padded places in ``ingest_features``; padding rows keep whatever they held (their
        outputs are dropped and they write no KV, so nothing reads them)."""
        if num_real == num_rows:
            self.ingest_features[:num_rows].copy_(features)
        else:
            self.ingest_features.index_copy_(0, index[:num_real], features.to(self.ingest_features.dtype))

    @torch.inference_mode()
    def run_ingest(
        self,
        input_ids: list[int],  # [sum(query_lens)] packed: each request's queued entries' tokens
        features: torch.Tensor,  # [sum(query_lens), fc_in_features] their target features (unfused), packed
        query_lens: list[int],  # [num_rows] queued entries per request
        computed: list[int],  # [num_rows] head entries cached before the ingest
        tables: list[list[int]],  # [num_rows][blocks] head block tables, query_len + steps positions reserved
        steps: int,
        read: bool = True,
    ) -> list[list[int]]:  # [num_rows][1 + steps] drafts 1 .. steps + 1; [] when not ``read``
        """One static ingest (and ``steps`` chain steps) over the packed queues. With ``read`` False nothing is read
        back (no host sync)."""
        n = len(query_lens)
        bucket = bucket_for(self.buckets, n)
        q = self._ingest_len(query_lens)
        assert bucket is not None and self.fits_ingest(query_lens, steps, max(computed) + max(query_lens) + steps), \
            "ingest does not fit"
        forward, graph = self._ingest_step(bucket, q, steps)  # may capture: before these values load
        num_real = self._stage_ingest(input_ids, query_lens, computed, tables, bucket, q, steps)
        self._place_features(features, bucket * q, num_real, self._ingest_views(bucket, q, steps)[8])
        self._replay(forward, graph)
        return self.ingest_drafts[:1 + steps, :n].t().tolist() if read else []

    @torch.inference_mode()
    def run_catch_up(
        self,
        input_ids: list[int],  # [sum(query_lens)] packed: each request's queued entries' tokens
        features: torch.Tensor,  # [sum(query_lens), fc_in_features] their target features (unfused), packed
        query_lens: list[int],  # [num_rows] entries to ingest per request (0: none)
        computed: list[int],  # [num_rows] head entries cached before
        tables: list[list[int]],  # [num_rows][blocks] head block tables, query_len positions reserved
    ) -> None:
        """Ingest the queues and draft nothing, reading nothing back (no host sync: it can be enqueued behind a
        step still in flight): the ingest graph of their padded length, or up to ``catch_up_chunks`` passes of
        ``max_ingest`` entries in one graph when they are longer (the adaptive policy's cap-0 steps leave a
        drafter up to that many steps behind: one catch-up of 64 entries instead of four of 16 at batch 8)."""
        n = len(query_lens)
        assert self.fits_catch_up(query_lens, computed), "catch-up does not fit"
        bucket = bucket_for(self.buckets, n)
        q, chunks = self._catch_up_shape(max(query_lens))
        forward, graph = self._ingest_step(bucket, q, 0, chunks)
        num_real = self._stage_ingest(input_ids, query_lens, computed, tables, bucket, q, 0, chunks)
        self._place_features(features, chunks * bucket * q, num_real, self._ingest_views(bucket, q, 0, chunks)[8])
        self._replay(forward, graph)

    def _replay(self, forward, graph) -> None:
        if graph is not None:
            graph.replay()
            self.num_replays += 1
        else:
            forward()
