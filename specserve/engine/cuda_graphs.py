"""CUDA graphs for decode and verify steps: padded static batches, captured per (batch bucket, query length).

An eager decode step of a small model is bound by the host: SmolLM2-135M (30 layers) launches a few hundred
kernels a step, ~15 ms at batch 1 on an H200 while the GPU work is well under 1 ms. A CUDA graph records those
launches once and replays them with one call. A graph fixes every shape and address, so it is captured per
(batch bucket B, query length q) and a step replays one when every scheduled sequence has a short query
(1 for decode, 1 + drafts for verify; q = the longest, at most ``CudaGraphConfig.max_query_len``) and the batch
fits a bucket of ``CudaGraphConfig.batch_sizes``. The batch is padded to B rows of q tokens; padding writes no
KV (slot -1, which every backend skips) and its outputs are dropped. Steps with longer queries (prefill chunks)
or more sequences than the largest bucket run eagerly, as before.

Worked example, buckets (1, 2, 4, 8), block_size 4, three sequences decoding (q = 1):

    A: seq_len 6, table [7, 2]     -> position 5, slot 2*4 + 1 = 9
    B: seq_len 3, table [5]        -> position 2, slot 5*4 + 2 = 22
    C: seq_len 9, table [1, 3, 8]  -> position 8, slot 8*4 + 0 = 32

    3 sequences -> bucket 4; row P is padding:
    input_ids       = [a5  b2  c8   0]
    positions       = [ 5   2   8   0]
    slot_mapping    = [ 9  22  32  -1]      -1: the KV write is skipped
    seq_lens        = [ 6   3   9   1]      P attends to one key (block 0, slot 0) so its softmax stays finite
    query_start_loc = [0 1 2 3 4]          fixed per (bucket, q): row i's tokens are i*q .. i*q + q - 1
    block_tables    = [[7 2 x x] [5 x x x] [1 3 8 x] [0 x x x]]   (width = cdiv(max_model_len, block_size);
                       x = stale, never read: past the row's seq_len)
    hidden rows 0..2 are returned; row 3 is dropped.

A verify step with 2 drafts (q = 3) of the same three sequences pads to bucket 4 with three tokens per row:
12 tokens, ``query_start_loc = [0 3 6 9 12]``, P's positions ``[0 1 2]``, slots ``[-1 -1 -1]``, seq_len 3.
If B had no draft (query_len 1) in that step, its row would be ``[b2, pad, pad]`` with slots ``[22, -1, -1]``
and seq_len 3 + 2 = 5: b2 keeps position 5 - 3 + 0 = 2, and the causal mask hides the padding from it.

Buffers. Every graph reads its inputs from views of one int64 device buffer, ``staging``, laid out for its
(bucket B, q), T = B * q tokens:

    staging = [input_ids (T) | positions (T) | slot_mapping (T) | seq_lens (B) | block tables (B x w)
               | packed index of each real token (num_tokens; read after the replay, to drop padding)]

A step builds those values on the host, copies them with one host-to-device copy, moves the ``B x w`` block
tables (w = the blocks this step's longest sequence uses) into the fixed-width ``block_tables`` buffer, and
replays. Outputs are copied inside the graph into ``hidden_out`` (and ``aux_out`` for the layers an EAGLE head
reads), allocated outside the graphs' memory pool, so the next replay of a different graph cannot reuse their
memory. Every graph shares one memory pool (``torch.cuda.graph_pool_handle()``); captured largest bucket first,
the smaller graphs reuse the larger ones' intermediate memory.

With ``capture=False`` the same padded static-buffer step runs eagerly (any device, any backend with
``prepare_static``): that is how the CPU tests check the padding, the buffers and the slot -1 rule against the
ordinary path token for token. Draft steps stay eager here: an EAGLE-3 head's ingest and draft steps have their
own static forwards (``spec/draft_graphs.py``, ``CudaGraphConfig.draft_steps``); a draft model's steps are eager.

The technique is nano-vllm's and vLLM's (graphs per batch bucket, one pool, padded replay, slot -1 skipped).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specserve.config import CudaGraphConfig
from specserve.layers.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


def bucket_sizes(batch_sizes: tuple[int, ...], max_num_seqs: int) -> list[int]:
    """The configured buckets up to the first one that holds ``max_num_seqs`` (larger ones would never be used).

    Example: (1, 2, 4, 8, 16), max_num_seqs 5 -> [1, 2, 4, 8]; max_num_seqs 64 -> [1, 2, 4, 8, 16]."""
    out = []
    for b in batch_sizes:
        out.append(b)
        if b >= max_num_seqs:
            break
    return out


def bucket_for(buckets: list[int], num_seqs: int) -> int | None:
    """The smallest bucket holding ``num_seqs`` sequences (``buckets`` ascending), None when none does."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


class StagingBuffer:
    """A static int64 device buffer that steps' host-built values are copied into (graphs read views of it). On
    CUDA the values go through a pinned host copy: the host-to-device copy is then one asynchronous DMA instead
    of a copy through a temporary pageable tensor, and an event keeps the next load from overwriting the pinned
    buffer before that copy has read it."""

    def __init__(self, size: int, device: torch.device) -> None:
        with torch.inference_mode():
            self.device = torch.zeros(size, dtype=torch.int64, device=device)  # [size]
            self.host = torch.zeros(size, dtype=torch.int64, pin_memory=True) if device.type == "cuda" else None
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # the last copy out of ``host``

    def load(self, values: list[int]) -> None:
        """``device[:len(values)] = values``, asynchronously on CUDA."""
        self.host_view(len(values))[:] = values
        self.send(len(values))

    def host_view(self, n: int) -> np.ndarray:
        """A writable int64 view [n] of the values the next ``send(n)`` copies, for callers that fill them with
        numpy in place (no Python list of every value). On CUDA it first waits until the previous send's copy has
        read the pinned buffer; elsewhere it is the device buffer itself (``send`` then has nothing to do)."""
        if self.host is None:
            return self.device[:n].numpy()
        self._copied.synchronize()
        return self.host[:n].numpy()

    def send(self, n: int) -> None:
        """``device[:n] = host[:n]``: one asynchronous copy on CUDA, after ``host_view(n)`` was filled."""
        if self.host is not None:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
            self._copied.record()


def capture_graph(forward: Callable[[], None], pool, device: torch.device) -> torch.cuda.CUDAGraph:
    """Run ``forward`` once (Triton compiles, cuBLAS picks kernels), then record it into ``pool``."""
    forward()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        forward()
    torch.cuda.synchronize(device)
    return graph


def padded_step_values(
    input_ids: list[int],  # [sum(query_lens)] packed tokens
    positions: list[int],  # [sum(query_lens)]
    query_lens: list[int],  # [num_seqs], each <= query_len
    seq_lens: list[int],  # [num_seqs] cached + new tokens after this step
    block_tables: list[list[int]],  # [num_seqs][>= cdiv(seq_len, block_size)]
    query_len: int,
    bucket: int,
    block_size: int,
) -> tuple[list[int], int]:
    """The ``staging`` values of one step padded to ``bucket`` rows of ``query_len`` tokens (layout in the module
    docstring) and the table width ``w`` used. Padded rows: token 0, positions 0..q-1, slot -1, seq_len q, block
    table [0, 0, ..]. A row with fewer than ``query_len`` tokens gets padding tokens after its own (token 0,
    position 0, slot -1) and its seq_len grows by as many: its real tokens keep their positions
    ``seq_len - query_len + t``, and causality keeps them from seeing the padding. After the tables come the
    packed indices of the real tokens within the padded rows (``[sum(query_lens)]``), for the output gather.

    Example, query_len 3: query_lens [3, 1], seq_lens [9, 5] -> row 1 = [b4, pad, pad], seq_len 7, slots
    [s, -1, -1]; real token indices [0 1 2 3]."""
    q = query_len
    num_pad = bucket - len(seq_lens)
    padded_lens = [s + q - n for s, n in zip(seq_lens, query_lens)]
    widths = [-(-s // block_size) for s in padded_lens]
    width = max(widths, default=1)  # a capture's all-padding step has no real rows
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    tables: list[int] = []
    index: list[int] = []
    at = 0
    for row, (n, s_len, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
        ids.extend(input_ids[at:at + n])
        pos.extend(positions[at:at + n])
        at += n
        for p in range(s_len - n, s_len):
            slots.append(table[p // block_size] * block_size + p % block_size)
        index.extend(range(row * q, row * q + n))
        ids.extend([0] * (q - n))
        pos.extend([0] * (q - n))
        slots.extend([-1] * (q - n))
        used = min(len(table), width)
        tables.extend(table[:used])
        tables.extend([0] * (width - used))
    pad_tokens = num_pad * q
    values = (ids + [0] * pad_tokens
              + pos + list(range(q)) * num_pad
              + slots + [-1] * pad_tokens
              + padded_lens + [q] * num_pad
              + tables + [0] * (num_pad * width)
              + index)
    return values, width


@dataclass
class StaticStep:
    """One (bucket, query_len, aux layers) step over views of the runner's static buffers."""

    bucket: int
    query_len: int
    forward: Callable[[], None]  # the padded step, eager; reads the static inputs, writes hidden_out / aux_out
    aux_out: list[torch.Tensor]  # [max_tokens, hidden_size] per aux layer id, ascending
    graph: torch.cuda.CUDAGraph | None = None  # None without capture: forward() runs eagerly


class CudaGraphRunner:
    """Runs decode/verify steps padded into static buffers, replaying CUDA graphs when ``capture``.

    ``model`` / ``kv_caches`` / ``backend`` are the ``ModelRunner``'s; ``backend`` must implement
    ``prepare_static`` (and be ``capturable`` when ``capture``). Not thread-safe: one engine loop owns it."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend,
                 config: CudaGraphConfig, block_size: int, max_model_len: int, max_num_seqs: int,
                 device: torch.device, capture: bool) -> None:
        if capture and not getattr(backend, "capturable", False):
            raise ValueError(f"{type(backend).__name__} cannot be captured in a CUDA graph")
        if not hasattr(backend, "prepare_static"):
            raise ValueError(f"{type(backend).__name__} has no prepare_static()")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.config = config
        self.block_size = block_size
        self.device = device
        self.capture = capture
        self.buckets = bucket_sizes(config.batch_sizes, max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.max_query_len = config.max_query_len
        self.width = -(-max_model_len // block_size)  # block-table columns of every graph
        self.max_tokens = self.max_batch * self.max_query_len
        mc = model.config
        self.num_kv_heads = mc.num_key_value_heads
        dtype = next(model.parameters()).dtype
        self._staging = StagingBuffer(4 * self.max_tokens + self.max_batch + self.max_batch * self.width, device)
        self.staging = self._staging.device
        with torch.inference_mode():
            self.block_tables = torch.zeros((self.max_batch, self.width), dtype=torch.int64, device=device)
            self.hidden_out = torch.zeros((self.max_tokens, mc.hidden_size), dtype=dtype, device=device)
        self.aux_out: dict[int, torch.Tensor] = {}  # layer id -> [max_tokens, hidden_size]
        self.steps: dict[tuple[int, int, tuple[int, ...]], StaticStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.capture_seconds = 0.0
        self.pool_bytes = 0  # growth of reserved device memory while capturing (approximate pool size)
        self.num_replays = 0
        self.replays_by_query_len: dict[int, int] = {}  # q -> replays (capture) or static steps (no capture)

    # ---- which steps fit -----------------------------------------------------------------------
    def bucket_for(self, num_seqs: int) -> int | None:
        return bucket_for(self.buckets, num_seqs)

    def fits(self, query_lens: list[int], seq_lens: list[int]) -> bool:
        """True when every query is at most ``max_query_len`` tokens, the batch fits a bucket, and every
        sequence, padded to the longest query, fits the tables' fixed width."""
        if not query_lens or len(query_lens) > self.max_batch:
            return False
        q = max(query_lens)
        if q > self.max_query_len or min(query_lens) < 1:
            return False
        return max(s + q - n for s, n in zip(seq_lens, query_lens)) <= self.width * self.block_size

    # ---- static buffers ------------------------------------------------------------------------
    def _views(self, bucket: int, query_len: int):
        """(input_ids [T], positions [T], slot_mapping [T], seq_lens [B]) views of ``staging`` for one layout."""
        t = bucket * query_len
        s = self.staging
        return s[:t], s[t:2 * t], s[2 * t:3 * t], s[3 * t:3 * t + bucket]

    def _load(self, values: list[int], bucket: int, query_len: int, width: int) -> None:
        """One host-to-device copy of the step's values, then its block tables into the fixed-width buffer."""
        self._staging.load(values)
        at = 3 * bucket * query_len + bucket
        tables = self.staging[at:at + bucket * width].view(bucket, width)  # [B, w]
        self.block_tables[:bucket, :width].copy_(tables)

    def _aux_buffer(self, layer_id: int) -> torch.Tensor:
        if layer_id not in self.aux_out:
            with torch.inference_mode():
                self.aux_out[layer_id] = torch.zeros_like(self.hidden_out)
        return self.aux_out[layer_id]

    # ---- build / capture -----------------------------------------------------------------------
    def _num_splits(self, bucket: int) -> int | None:
        if self.config.num_splits is not None:
            return self.config.num_splits
        choose = getattr(self.backend, "graph_num_splits", None)  # the same with and without capture
        return choose(bucket, self.num_kv_heads, self.device) if choose is not None else None

    def _build(self, bucket: int, query_len: int, aux_layer_ids: tuple[int, ...]) -> StaticStep:
        q, t = query_len, bucket * query_len
        ids, pos, slots, seq_lens = self._views(bucket, q)
        meta = AttentionMetadata(
            num_tokens=t,
            query_lens=[q] * bucket,
            seq_lens=[],  # lives on the device only (seq_lens view); a replayed step never reads host lists
            slot_mapping=slots,
            block_tables=self.block_tables[:bucket],  # [B, width], contiguous rows
            query_start_loc=torch.arange(bucket + 1, dtype=torch.int64, device=self.device) * q,  # [B + 1]
        )
        num_splits = self._num_splits(bucket)
        aux_out = [self._aux_buffer(i) for i in aux_layer_ids]
        model, backend, kv_caches, block_size, hidden_out = (self.model, self.backend, self.kv_caches,
                                                             self.block_size, self.hidden_out)

        def forward() -> None:
            backend.prepare_static(meta, block_size, seq_lens.to(torch.int32), q, num_splits)
            hidden, aux = model(ids, pos, kv_caches, meta, backend, aux_layer_ids)  # [T, hidden_size]
            hidden_out[:t].copy_(hidden)
            for buf, a in zip(aux_out, aux):
                buf[:t].copy_(a)

        step = StaticStep(bucket, q, forward, aux_out)
        if self.capture:
            self._capture(step)
        return step

    def _capture(self, step: StaticStep) -> None:
        """Warm up once (Triton compiles, cuBLAS picks kernels), then record the step into the shared pool. The
        inputs are all padding while this runs, so neither pass writes KV."""
        bucket, q = step.bucket, step.query_len
        values, width = padded_step_values([], [], [], [], [], q, bucket, self.block_size)
        self._load(values, bucket, q, width)
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        step.graph = capture_graph(step.forward, self.pool, self.device)
        self.capture_seconds += time.perf_counter() - start
        self.pool_bytes += torch.cuda.memory_reserved(self.device) - reserved
        logger.debug("captured CUDA graph: batch %d, query_len %d", bucket, q)

    def step_for(self, bucket: int, query_len: int, aux_layer_ids: tuple[int, ...] = ()) -> StaticStep:
        """The step of this shape, built (and captured) on first use."""
        key = (bucket, query_len, tuple(sorted(aux_layer_ids)))
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = self._build(bucket, query_len, key[2])
        return step

    @torch.inference_mode()
    def capture_all(self, query_lens: list[int], aux_layer_ids: tuple[int, ...] = ()) -> None:
        """Build every bucket for each query length, largest bucket first (the smaller graphs then fit in the
        pool memory the larger ones already hold)."""
        start = time.perf_counter()
        for q in sorted(set(query_lens)):
            if 1 <= q <= self.max_query_len:
                for bucket in reversed(self.buckets):
                    self.step_for(bucket, q, aux_layer_ids)
        logger.info("CUDA graphs: %d steps (batch buckets %s, query lengths %s) in %.2f s, pool ~%.0f MiB",
                    len(self.steps), self.buckets, sorted(set(query_lens)), time.perf_counter() - start,
                    self.pool_bytes / 2**20)

    # ---- run -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self,
        input_ids: list[int],  # [num_tokens] packed, as ModelRunner.forward takes them
        positions: list[int],  # [num_tokens]
        query_lens: list[int],  # [num_seqs]
        seq_lens: list[int],  # [num_seqs]
        block_tables: list[list[int]],  # [num_seqs][num_blocks of the sequence]
        aux_layer_ids: tuple[int, ...] = (),
        input_ids_device: torch.Tensor | None = None,  # [num_tokens] int64 (decode only): replaces input_ids
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A step that ``fits()`` -> ``(hidden [num_tokens, hidden_size], aux hidden list in ascending layer id
        order)`` in packed token order, like ``ModelRunner.forward``. When no row was padded, ``hidden`` is a
        view of ``hidden_out`` valid until the next ``run``; otherwise (and for aux) a gathered copy.
        ``input_ids_device`` (a decode step, q = 1: token i is row i): copied over the staged ids on the device,
        after the host values and before the replay (stream order)."""
        num_seqs, num_tokens = len(seq_lens), len(input_ids)
        bucket = self.bucket_for(num_seqs)
        assert bucket is not None and self.fits(query_lens, seq_lens), "step does not fit the static buffers"
        q = max(query_lens)
        step = self.step_for(bucket, q, aux_layer_ids)  # may capture: before the step's values load
        values, width = padded_step_values(input_ids, positions, query_lens, seq_lens, block_tables, q, bucket,
                                           self.block_size)
        self._load(values, bucket, q, width)
        if input_ids_device is not None:
            if q != 1:
                raise ValueError("input_ids_device: only for decode steps (one token per sequence)")
            self.staging[:num_tokens].copy_(input_ids_device)
        if step.graph is not None:
            step.graph.replay()
            self.num_replays += 1
        else:
            step.forward()
        self.replays_by_query_len[q] = self.replays_by_query_len.get(q, 0) + 1
        if num_tokens == num_seqs * q:  # every row full: real tokens are the first num_tokens rows
            return self.hidden_out[:num_tokens], [buf[:num_tokens].clone() for buf in step.aux_out]
        index = self.staging[len(values) - num_tokens:len(values)]  # [num_tokens] rows of the real tokens
        return (self.hidden_out.index_select(0, index), [buf.index_select(0, index) for buf in step.aux_out])
