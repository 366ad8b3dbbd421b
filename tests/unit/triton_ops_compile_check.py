"""Compile the ``TritonOps`` kernels (``layers/triton_ops.py``) for a GPU target on a machine without one.

The interpreter that runs ``test_triton_ops.py`` on CPU never lays out or lowers a kernel; this script runs
each op on CPU tensors of real model shapes with the kernels replaced by recorders (as
``triton_compile_check.py`` does for attention) and compiles every distinct launch for sm_90 (H100/H200):

    PYTHONPATH=. python tests/unit/triton_ops_compile_check.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # kernels must be JITFunctions, not interpreted ones

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from specserve.layers import triton_ops  # noqa: E402
from tests.unit.triton_compile_check import Recorder, compile_launches  # noqa: E402

KERNELS = ("_rms_norm_kernel", "_silu_and_mul_kernel", "_rope_kernel", "_silu_and_mul_fp8_kernel",
           "_silu_and_mul_amax_kernel", "_quantize_blocks_kernel")
# (hidden, intermediate, num_heads, num_kv_heads, head_dim): SmolLM2-135M, Llama-3.1-8B, Qwen2.5-0.5B (14/2/64)
SHAPES = [(576, 1536, 9, 3, 64), (4096, 14336, 32, 8, 128), (896, 4864, 14, 2, 64)]


def run_ops_on_cpu(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, num_tokens: int, fp8: bool = False) -> None:
    ops = triton_ops.TritonOps()
    x = torch.zeros(num_tokens, hidden, dtype=dtype)
    weight = torch.ones(hidden, dtype=dtype)
    ops.rms_norm(x, weight, 1e-5)
    ops.fused_add_rms_norm(x, torch.zeros_like(x), weight, 1e-5)
    ops.rms_norm(torch.zeros(num_tokens * num_heads, head_dim, dtype=dtype), torch.ones(head_dim, dtype=dtype),
                 1e-6)  # QK-norm (Qwen3): one row per head
    ops.silu_and_mul(torch.zeros(num_tokens, 2 * intermediate, dtype=dtype))
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.zeros(num_tokens, q_size + 2 * kv_size, dtype=dtype)
    cos = torch.zeros(num_tokens, 1, head_dim, dtype=dtype)
    ops.rope_(qkv[:, :q_size + kv_size].view(num_tokens, num_heads + num_kv_heads, head_dim), cos, cos)
    if fp8:  # the fused FP8 activation quantizer variants (what an FP8 model's layers call)
        ops.rms_norm_fp8(x, weight, 1e-5)
        ops.fused_add_rms_norm_fp8(x, torch.zeros_like(x), weight, 1e-5)
        for rows in (num_tokens, triton_ops.SILU_FP8_SPLIT_MAX_ROWS + 1):  # two launches / one program per row
            ops.silu_and_mul_fp8(torch.zeros(rows, 2 * intermediate, dtype=dtype))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    ap.add_argument("--fp8", action="store_true", help="also the fused FP8 quantizer variants (bf16/fp16)")
    args = ap.parse_args(argv)
    launches: list = []
    originals = {name: getattr(triton_ops, name) for name in KERNELS}
    try:
        for name, fn in originals.items():
            setattr(triton_ops, name, Recorder(fn, launches))
        for shape in SHAPES:
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                run_ops_on_cpu(*shape, dtype, num_tokens=3, fp8=args.fp8 and dtype != torch.float32)
    finally:
        for name, fn in originals.items():
            setattr(triton_ops, name, fn)
    start = time.perf_counter()
    n = compile_launches(launches, GPUTarget("cuda", args.arch, 32))
    print(f"{n} kernel variants compiled for sm_{args.arch} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
