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
kernel before me has completed" holds transitively for the whole stream. One exception: with
``TileConfig.prefetch`` the W8A16 kernel loads its first weight tiles before ``pdl_begin``. Weights are written
only when a model loads (by torch, never by a kernel of a step), and the kernel still waits before it reads
activations or writes anything and before it lets the next kernel launch, so the chain holds. A kernel launched
without the option (torch's, cuBLAS's) is ordered as usual; a PDL kernel that follows one simply starts when it
completes.

``ENABLED`` is read at every launch (benchmarks flip it for an A/B run; a captured CUDA graph keeps what it
captured); ``SPECSERVE_DISABLE_PDL=1`` turns PDL off for the process. Off on CPU, under ``TRITON_INTERPRET=1``
and on GPUs before compute capability 9.0. Measured on an H200 (``benchmarks/pdl_gpu.py``,
``benchmarks/results/pdl_gpu.json``, ``pdl_early_gpu.json``): the same logits bit for bit, and the
graph-replayed Llama-3.1-8B-shape step at batch 1 x1.016 / x1.040 faster in bf16 and x1.073 / x1.077 in FP8
(where the projections are shortest) in two runs; at batch 32 and on the SmolLM2 shape the runs differ by more
than PDL's effect (x0.98 to x1.14).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = True
# False: a kernel waits for the one before it, then lets the next launch (at most two kernels resident at once).
# True: it lets the next launch first, then waits, so a chain of short kernels can all be resident, each waiting
# on the one before it (the same order of memory effects: every kernel still waits before touching memory).
# Measured slower on the H200 at batch 1 (x0.94 against PDL off, Llama-3.1-8B shape, bf16 and fp8;
# benchmarks/results/pdl_early_gpu.json), presumably because waiting programs hold resources the running kernel
# could use (not profiled).
EARLY_LAUNCH = False


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def supports_pdl(capability_major: int) -> bool:
    """Whether a GPU of this compute capability major has PDL (Hopper, 9.0, and later)."""
    return capability_major >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: ``ENABLED``, no ``SPECSERVE_DISABLE_PDL=1``, a CUDA device that
    ``supports_pdl``, and not the Triton interpreter."""
    if (not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
            or os.environ.get("SPECSERVE_DISABLE_PDL") == "1"):
        return False
    return supports_pdl(_capability_major(device.index if device.index is not None else torch.cuda.current_device()))


def launch_args(on: bool) -> dict:
    """The launch keywords of a kernel taking ``USE_PDL`` with PDL ``on`` or off: its constexpr (0: off, 1: wait
    then launch the next, 2: launch the next then wait; see ``EARLY_LAUNCH``) and Triton's ``launch_pdl`` option.
    The sm_90 compile checks (tests/unit/*_compile_check.py) build with ``launch_args(True)``."""
    mode = (2 if EARLY_LAUNCH else 1) if on else 0
    return {"USE_PDL": mode, "launch_pdl": mode > 0}


def pdl_args(device: torch.device) -> dict:
    """``launch_args`` for a launch on ``device`` (``use_pdl``)."""
    return launch_args(use_pdl(device))


@triton.jit
def pdl_begin(USE_PDL: tl.constexpr):
    """Wait for the previous kernel in the stream to complete (its writes visible) and allow the next kernel to
    launch, in that order (``USE_PDL`` 1) or the other (2). Call before the kernel's first global load or store
    (only loads of data no kernel writes, such as weights, may come before it); a no-op when ``USE_PDL`` is 0."""
    if USE_PDL == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    elif USE_PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
