"""L2 warm-up of a projection's weights while the short kernels before it run (GPU decode steps at small batch).

A decode layer at batch 1 alternates weight-bound GEMVs (qkv, o, gate|up, down) with short latency-bound
kernels (the norms, rope + KV write, attention, SiLU-and-mul). While those short kernels run, HBM is nearly idle;
and each GEMV starts cold, its first weight tiles one memory round trip away. Here a small kernel launched
inside such a window asks the L2 cache to fetch the bytes the next GEMV's programs read first, so that HBM
works through the window and the GEMV's first tiles are L2 hits. It uses the PTX L2 prefetch hints
(``cp.async.bulk.prefetch.L2``: one instruction per contiguous chunk, through the tensor memory accelerator; or
``prefetch.global.L2::evict_last``, one per 128-byte line): no registers are filled, nothing is returned or
written, and the results of every kernel are unchanged bit for bit. It is a performance hint only: on CPU and
under the Triton interpreter nothing is launched.

Which bytes: a GEMV program streams its weight tile along K from the start of its K range (``ReadPlan``: for
each storage row and each split-K range, where that range starts and how long it is), so the warm-up takes the
first ``prefix`` bytes of every (row, split) range, ``prefix`` chosen so that the total fits a byte budget (what
HBM can deliver during the window, and well under the L2's capacity).

Example: a W8A16 o_proj (4096 x 4096 e4m3, one byte per weight) at batch 1 is read as 64 tiles of 64 rows in
5 split-K ranges of 896 bytes (the last 512; ``split_bytes`` is the shortest, so no warm-up runs past a range):
``ReadPlan(rows=4096, row_stride=4096, splits=5, split_stride=896, split_bytes=512)``. A budget of 8 MiB gives
8 MiB / (4096 * 5) = 409 bytes, rounded down to whole lines: 384 bytes at the start of each of the 20480 ranges
(7.5 MiB), the first three 128-byte K tiles of every range.

In a step's chain of programmatic-dependent launches (``layers/triton_pdl.py``) the kernel lets the next one
launch first, then issues its prefetches, and waits for the kernel before it last: so the chain's order of
memory effects is kept and the next kernel's launch overlaps it. Launched right after a window's first kernel,
its prefetches start as soon as the GEMV before the window has finished.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specserve.layers import quant_tiles
from specserve.layers.triton_pdl import pdl_args

LINE = 128  # bytes of an L2 line: the granularity of the prefix
BULK_CHUNK = 4096  # bytes per bulk prefetch instruction (a multiple of 16)
# prefetch instructions per program (4 warps): one bulk prefetch per thread, so that many SMs' copy engines share
# the work; four line prefetches per thread
ITEMS_BULK, ITEMS_LINE = 128, 512


@dataclass(frozen=True)
class ReadPlan:
    """The order in which a GEMV kernel reads a weight: for each of ``rows`` storage rows (``row_stride`` bytes
    apart) and each of ``splits`` split-K ranges (``split_stride`` bytes apart within a row), a contiguous range
    of ``split_bytes`` bytes read front to back. ``tensor`` is the weight's storage (contiguous)."""

    tensor: torch.Tensor
    rows: int
    row_stride: int
    splits: int
    split_stride: int
    split_bytes: int

    def prefix(self, budget: int) -> int:
        """Bytes to warm at the start of each range for a ``budget`` of bytes in all: whole lines, at least
        one line, at most the range (0: nothing, for a budget <= 0)."""
        if budget <= 0 or self.split_bytes <= 0:
            return 0
        each = budget // (self.rows * self.splits) // LINE * LINE
        return min(self.split_bytes, max(LINE, each))


@triton.jit
def _l2_prefetch_kernel(
    base,  # int64 address of the weight storage's first byte
    num_items,  # prefetch instructions in all: rows * splits * chunks
    splits, chunks,  # item i = ((row * splits) + split) * chunks + chunk
    row_stride, split_stride, prefix,  # bytes
    ITEMS: tl.constexpr,  # items per program
    CHUNK: tl.constexpr,  # bytes per item (LINE without BULK)
    BULK: tl.constexpr,  # cp.async.bulk.prefetch.L2 (True) or prefetch.global.L2 (False)
    USE_PDL: tl.constexpr,
):
    if USE_PDL != 0:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch now: nothing here is read by it
    i = tl.program_id(0) * ITEMS + tl.arange(0, ITEMS)
    i = tl.minimum(i, num_items - 1)  # lanes past the end repeat the last item (a duplicate hint is harmless)
    chunk = i % chunks
    rs = (i // chunks).to(tl.int64)
    offset = chunk.to(tl.int64) * CHUNK
    addr = base + (rs // splits) * row_stride + (rs % splits) * split_stride + offset  # [ITEMS] int64
    if BULK:
        size = tl.minimum(prefix - offset, CHUNK).to(tl.int32)  # multiples of 16 (prefix is whole lines)
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [addr], dtype=tl.int32, is_pure=False, pack=1)
    if USE_PDL != 0:
        tl.extra.cuda.gdc_wait()  # the kernel after this one waits for it, so it waits for the one before


def launch_prefetch(plan: ReadPlan, budget: int, bulk: bool = True) -> int:
    """Warm the L2 with the first bytes of each range of ``plan`` within ``budget`` bytes (a budget of the whole
    weight or more: all of it, front to back); returns the bytes asked for (0 and no launch on CPU, under the
    interpreter, or for an empty plan)."""
    w = plan.tensor
    nbytes = w.numel() * w.element_size()
    if budget >= nbytes:  # the whole weight: one contiguous range, whatever the kernel's order
        plan = ReadPlan(w, 1, 0, 1, 0, nbytes)
    prefix = plan.prefix(budget)
    if prefix == 0 or w.device.type != "cuda" or not w.is_contiguous() or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    # a bulk prefetch takes 16-byte aligned addresses and sizes; other layouts take the per-line form
    bulk = bulk and (w.data_ptr() | plan.row_stride | plan.split_stride) % 16 == 0 and prefix >= 16
    if bulk:
        prefix -= prefix % 16
    chunk, items = (BULK_CHUNK, ITEMS_BULK) if bulk else (LINE, ITEMS_LINE)
    chunks = triton.cdiv(prefix, chunk)
    num_items = plan.rows * plan.splits * chunks
    _l2_prefetch_kernel[(triton.cdiv(num_items, items),)](
        w.data_ptr(), num_items, plan.splits, chunks, plan.row_stride, plan.split_stride, prefix,
        ITEMS=items, CHUNK=chunk, BULK=bulk, num_warps=4, **pdl_args(w.device))
    return plan.rows * plan.splits * prefix


def _ranges(k: int, split: int, k_per_split: int) -> tuple[int, int]:
    """(splits, elements of the shortest split-K range) of K cut into ``split`` ranges of ``k_per_split``."""
    return split, min(k_per_split, k - (split - 1) * k_per_split)


def read_plan(
    proj: torch.nn.Module,  # Linear (16-bit weight), Fp8Linear or Int4Linear
    num_rows: int,
) -> ReadPlan | None:
    """How ``proj``'s forward over ``num_rows`` rows reads its weight on the GPU (the launch plan of the kernel it
    takes: ``gemv_plan``, ``w8a16_plan``, ``w4a16_plan``; cuBLAS / ``_scaled_mm`` are taken to read every row
    from K = 0 on), or None for a module without a weight this knows."""
    from specserve.layers.quant_gpu import Fp8Linear, Int4Linear  # lazily: no import cycle through linear.py

    if isinstance(proj, Fp8Linear):
        w = proj.weight  # [N, K] e4m3: one byte per weight
        n, k = w.shape
        max_rows = quant_tiles.W8A16_MAX_ROWS if proj.max_triton_rows is None else proj.max_triton_rows
        if num_rows <= max_rows and proj.use_triton is not False:
            from specserve.layers.triton_w8a16 import w8a16_plan
            *_, split, k_per_split = w8a16_plan(num_rows, n, k, w.device)
            splits, shortest = _ranges(k, split, k_per_split)
            return ReadPlan(w, n, k, splits, k_per_split, shortest)
        return ReadPlan(w, n, k, 1, 0, k)
    if isinstance(proj, Int4Linear):
        q = proj.qweight  # [K // 8, N] int32: a K range is a block of whole word rows
        from specserve.layers.triton_w4a16 import w4a16_plan
        k, n = proj.in_features, proj.out_features
        *_, split, k_per_split = w4a16_plan(num_rows, n, k, proj.group_size, q.device)
        splits, shortest = _ranges(k, split, k_per_split)
        row_bytes = n * q.element_size()
        return ReadPlan(q, 1, 0, splits, k_per_split // 8 * row_bytes, shortest // 8 * row_bytes)
    w = getattr(proj, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.element_size() != 2:
        return None
    n, k = w.shape
    e = w.element_size()
    if 0 < num_rows <= quant_tiles.BF16_GEMV_MAX_ROWS and w.numel() >= quant_tiles.BF16_GEMV_MIN_WEIGHT:
        from specserve.layers.triton_gemv import gemv_plan
        *_, split, k_per_split = gemv_plan(num_rows, n, k, w.device)
        splits, shortest = _ranges(k, split, k_per_split)
        return ReadPlan(w, n, k * e, splits, k_per_split * e, shortest * e)
    return ReadPlan(w, n, k * e, 1, 0, k * e)


def prefetch_weights(
    proj: torch.nn.Module,  # the projection the window's GEMV runs
    num_rows: int,  # rows of the step (the GEMV's M)
    window: str,  # a key of quant_tiles.WEIGHT_PREFETCH: "qkv", "o", "gate_up", "down"
) -> int:
    """The warm-up ``quant_tiles.WEIGHT_PREFETCH`` asks for before ``proj``'s GEMV in ``window`` (bytes asked
    for; 0: off, more than ``WEIGHT_PREFETCH_MAX_ROWS`` rows, no budget for the window, or nothing to launch)."""
    budgets = quant_tiles.WEIGHT_PREFETCH
    if not budgets or not 0 < num_rows <= quant_tiles.WEIGHT_PREFETCH_MAX_ROWS or budgets.get(window, 0) <= 0:
        return 0
    plan = read_plan(proj, num_rows)
    if plan is None:
        return 0
    return launch_prefetch(plan, budgets[window], bulk=quant_tiles.WEIGHT_PREFETCH_BULK)
