"""Compile the Triton attention kernels for a GPU target on a machine without one (Triton ships ptxas).

The interpreter that runs the unit tests on CPU executes the kernels in numpy and never type-checks, lays out
or lowers them, so a kernel can pass every interpreted test and still fail to compile. This script runs
``TritonAttentionBackend.forward`` (with and without rope tables) on CPU tensors with each kernel replaced by a
recorder, then compiles every distinct launch it recorded (the real arguments, constexprs and launch options)
for sm_90 (H100/H200):

    PYTHONPATH=. python tests/unit/triton_compile_check.py            # Llama-3.1-8B and SmolLM2 shapes
    PYTHONPATH=. python tests/unit/triton_compile_check.py --quick    # one shape, bf16 only
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # kernels must be JITFunctions, not interpreted ones

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from specserve.layers import triton_attention, triton_pdl  # noqa: E402
from specserve.layers.attention import build_attention_metadata  # noqa: E402

KERNELS = ("_write_kv_kernel", "_rope_write_kv_kernel", "_decode_kernel", "_combine_splits_kernel", "_prefill_kernel")


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch instead of running it."""

    def __init__(self, fn, launches: list) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, dict(kwargs)))


def record_launches(shapes, dtypes, splits, batches) -> list:
    launches: list = []
    originals = {name: getattr(triton_attention, name) for name in KERNELS}
    try:
        for name, fn in originals.items():
            setattr(triton_attention, name, Recorder(fn, launches))
        for num_heads, num_kv_heads, head_dim in shapes:
            for dtype in dtypes:
                for num_splits in splits:
                    for query_lens, context_lens in batches:
                        forward_on_cpu(num_heads, num_kv_heads, head_dim, dtype, num_splits, query_lens,
                                       context_lens)
    finally:
        for name, fn in originals.items():
            setattr(triton_attention, name, fn)
    return launches


def forward_on_cpu(num_heads, num_kv_heads, head_dim, dtype, num_splits, query_lens, context_lens,
                   block_size: int = 16) -> None:
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    tables, at = [], 0
    for s in seq_lens:
        n = (s + block_size - 1) // block_size
        tables.append(list(range(at, at + n)))
        at += n
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, torch.device("cpu"))
    t = meta.num_tokens
    qkv = torch.zeros(t, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)  # fused, as the model has it
    q = qkv[:, :num_heads * head_dim].view(t, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(t, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(t, num_kv_heads, head_dim)
    k_cache = torch.zeros(at, block_size, num_kv_heads, head_dim, dtype=dtype)
    backend = triton_attention.TritonAttentionBackend(num_splits=num_splits)
    backend.prepare(meta, block_size)
    backend.forward(q, k, v, k_cache, torch.zeros_like(k_cache), meta)
    cos_sin = torch.zeros(t, 2, head_dim, dtype=dtype)  # the rope tables' layout (layers/rope.py: row stride 2 d)
    backend.forward(q, k, v, k_cache, torch.zeros_like(k_cache), meta, rope=(cos_sin[:, 0:1], cos_sin[:, 1:2]))


def compile_launches(launches: list, target: GPUTarget) -> int:
    seen = set()
    for fn, args, kwargs in launches:
        options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "enable_fp_fusion") if key in kwargs}
        if "USE_PDL" in kwargs:  # recorded on CPU (off); compile what a GPU of this target launches
            kwargs |= triton_pdl.launch_args(triton_pdl.supports_pdl(target.arch // 10))
            options["launch_pdl"] = kwargs.pop("launch_pdl")
        bound = dict(zip(fn.arg_names, args)) | kwargs
        signature, constexprs = {}, {}
        for param in fn.params:
            value = bound[param.name]
            if param.is_constexpr:
                signature[param.name], constexprs[param.name] = "constexpr", value
            else:
                signature[param.name] = mangle_type(value)
        key = (fn.__name__, tuple(signature.items()), tuple(constexprs.items()), tuple(options.items()))
        if key in seen:
            continue
        seen.add(key)
        start = time.perf_counter()
        compiled = triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options)
        print(f"{fn.__name__:24s} {constexprs} {options} shared={compiled.metadata.shared} B "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    return len(seen)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Llama-3.1-8B shape in bf16 only")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    args = ap.parse_args(argv)
    # decode only; verify (query lens up to 16) mixed with decode; a prefill chunk with decode and verify rows
    batches = [([1, 1, 1], [100, 300, 7]), ([4, 8, 1], [100, 300, 7]), ([16, 2, 40], [100, 300, 7])]
    if args.quick:
        launches = record_launches([(32, 8, 128)], [torch.bfloat16], [1, 4], batches)
    else:
        launches = record_launches([(32, 8, 128), (9, 3, 64)], [torch.bfloat16, torch.float32], [1, 4], batches)
    start = time.perf_counter()
    n = compile_launches(launches, GPUTarget("cuda", args.arch, 32))
    print(f"{n} kernel variants compiled for sm_{args.arch} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
