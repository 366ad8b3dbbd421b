"""Compile the Triton W4A16 GEMM for a GPU target on a machine without one (Triton ships ptxas), for every tile
configuration ``w4a16_linear`` picks (M = 1 .. 4096), bf16 and fp16 activations, Llama-3.1-8B projection shapes.
The interpreter that runs the unit tests never type-checks, lays out or lowers a kernel.

    PYTHONPATH=. python tests/unit/w4a16_compile_check.py [--arch 90]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # the kernel must be a JITFunction, not an interpreted one

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from specserve.layers import triton_w4a16  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args(argv)
    fn = triton_w4a16._w4a16_kernel
    seen = set()
    start = time.perf_counter()
    for dtype, tname in ((torch.bfloat16, "*bf16"), (torch.float16, "*fp16"), (torch.float32, "*fp32")):
        for m in (1, 17, 48, 200, 4096):
            for group_size in (128, 64):
                block_m, block_n, block_k, num_warps, num_stages = triton_w4a16._tile_config(m)
                block_k = min(block_k, group_size)
                for split in (False, True):
                    out = "*fp32" if split else tname
                    precision = "ieee" if dtype == torch.float32 else "tf32"
                    constexprs = {"GROUP_SIZE": group_size, "BLOCK_M": block_m, "BLOCK_N": block_n,
                                  "BLOCK_K": block_k, "PRECISION": precision}
                    key = (tname, out, tuple(constexprs.items()), num_warps, num_stages)
                    if key in seen:
                        continue
                    seen.add(key)
                    signature = {"x_ptr": tname, "qweight_ptr": "*i32", "scales_ptr": tname, "zeros_ptr": tname,
                                 "out_ptr": out}
                    for name in fn.arg_names[5:]:
                        signature[name] = "constexpr" if name in constexprs else "i32"
                    t0 = time.perf_counter()
                    compiled = triton.compile(ASTSource(fn, signature, constexprs),
                                              target=GPUTarget("cuda", args.arch, 32),
                                              options={"num_warps": num_warps, "num_stages": num_stages})
                    print(f"{tname} -> {out} {constexprs} warps={num_warps} stages={num_stages} "
                          f"shared={compiled.metadata.shared} B ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{len(seen)} W4A16 variants compiled for sm_{args.arch} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
