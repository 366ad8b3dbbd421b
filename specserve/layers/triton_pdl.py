"""Programmatic dependent launch (PDL) for the Triton kernels of a forward step (NVIDIA Hopper and later; CUDA
programming guide, "Programmatic Dependent Launch and Synchronization"; PTX ``griddepcontrol``).

A decode step at a small batch is a chain of a few hundred short kernels (norm, projection, rope, KV write,
attention, ...). Without PDL each kernel's programs are launched only once the previous kernel has finished, so
every boundary costs the launch and ramp-up of a grid on top of the work. With PDL a kernel launched with the
``launch_pdl`` option may be scheduled as soon as every program of the kernel before it has signalled
(``gdc_launch_dependents``); its programs then wait (``gdc_wait``) until that kernel has completed and its
memory writes are visible, and only then touch memory. So the grid launch overlaps the previous kernel's work
and the results are the same bits as without it.

Every kernel that takes ``USE_PDL`` calls ``pdl_begin`` before its first global memory access: it waits for the
kernel before it, then lets the next one launch. Because each such kernel waits before any load or store, "the
kernel before me has completed" holds transitively for the whole stream. A kernel launched without the option
(torch's, cuBLAS's) is ordered as usual; a PDL kernel that follows one simply starts when it completes.

``ENABLED`` is read at every launch (benchmarks flip it for an A/B run; a captured CUDA graph keeps what it
captured); ``SPECSERVE_DISABLE_PDL=1`` turns PDL off for the process. Off on CPU, under ``TRITON_INTERPRET=1``
and on GPUs before compute capability 9.0. Measured on an H200 (``benchmarks/pdl_gpu.py``,
``benchmarks/results/pdl_gpu.json``): the same logits bit for bit, and the graph-replayed Llama-3.1-8B-shape
step at batch 1 x1.016 faster in bf16 and x1.073 in FP8 (where the projections are shortest).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = True
# Weight prefetch into L2 before the wait (``prefetch_weights_l2``): a projection whose weights take at most this
# many bytes has each program prefetch its whole slab (the matrix then fits in the 50-60 MB L2 of a Hopper part
# beside the activations); a larger one only the first ``PREFETCH_HEAD_LINES`` 128-byte lines of each row.
PREFETCH = True  # read at every launch, like ENABLED
PREFETCH_WHOLE_MAX_BYTES = 36 << 20
PREFETCH_HEAD_LINES = 8
PREFETCH_MAX_LINES = 128  # per row and program (a power of two)


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def use_pdl(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: ``ENABLED``, no ``SPECSERVE_DISABLE_PDL=1``, a CUDA device of
    compute capability >= 9.0, and not the Triton interpreter."""
    if (not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
            or os.environ.get("SPECSERVE_DISABLE_PDL") == "1"):
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


def pdl_args(device: torch.device) -> dict:
    """The launch keywords of a kernel taking ``USE_PDL``: its constexpr and Triton's ``launch_pdl`` option."""
    flag = use_pdl(device)
    return {"USE_PDL": flag, "launch_pdl": flag}


def prefetch_lines(n: int, k: int, k_per_split: int, elem_bytes: int, device: torch.device) -> int:
    """The ``LINES`` constexpr of ``prefetch_weights_l2`` for a launch over an ``[n, k]`` weight of
    ``elem_bytes``-byte elements split in K ranges of ``k_per_split``: 0 without PDL (the prefetch only pays
    while the previous kernel runs) or with ``PREFETCH`` off, else the 128-byte lines of a program's row slab
    (or its head), rounded up to a power of two."""
    if not PREFETCH or not use_pdl(device):
        return 0
    lines = triton.cdiv(k_per_split * elem_bytes, 128)
    if n * k * elem_bytes > PREFETCH_WHOLE_MAX_BYTES:
        lines = min(lines, PREFETCH_HEAD_LINES)
    return triton.next_power_of_2(min(lines, PREFETCH_MAX_LINES))


@triton.jit
def prefetch_weights_l2(
    w_ptr,  # [N, K] weights, rows stride_wn apart, elements stride_wk apart
    N, K, k_per_split, stride_wn, stride_wk,
    BLOCK_N: tl.constexpr,  # rows per program: program_id(0) covers rows [pid * BLOCK_N, (pid + 1) * BLOCK_N)
    ELEM_BYTES: tl.constexpr,
    LINES: tl.constexpr,  # 128-byte lines per row from the start of this program's K range (0: none)
):
    """Ask L2 for the first ``LINES`` lines of each weight row this program will stream (its K range is
    ``program_id(2) * k_per_split`` onwards), without waiting for them. Weights are never written by a
    kernel, so this may run before ``pdl_begin``: while the previous kernel still works, the loads that follow
    the wait then hit L2. Addresses are clamped into the matrix (a row past N reads row N - 1)."""
    if LINES > 0:
        rows = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)  # [BLOCK_N]
        k_lo = tl.program_id(2) * k_per_split
        k_last = tl.minimum(k_lo + k_per_split, K) - 1
        cols = tl.minimum(k_lo + tl.arange(0, LINES) * (128 // ELEM_BYTES), k_last).to(tl.int64)  # [LINES]
        ptrs = w_ptr + rows[:, None] * stride_wn + cols[None, :] * stride_wk  # [BLOCK_N, LINES]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_begin(USE_PDL: tl.constexpr):
    """Wait for the previous kernel in the stream to complete (its writes visible), then allow the next kernel
    to launch. Call before the kernel's first global load or store; a no-op when ``USE_PDL`` is off."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
