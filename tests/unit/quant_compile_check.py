"""Compile the quantized-GEMM Triton kernels for a GPU target on a machine without one (Triton ships ptxas): the
W8A16 GEMM and the FP8 activation quantizer (``layers/triton_w8a16.py``), the W4A16 GEMM
(``layers/triton_w4a16.py``), the 16-bit-weight GEMV (``layers/triton_gemv.py``) and tensor-core GEMM
(``layers/triton_gemm.py``), and the persistent FP8 MLP block (``layers/triton_fused_mlp.py``). The
interpreter that runs the unit tests never type-checks, lays out or lowers a kernel, so a kernel can pass every
interpreted test and still fail to compile.

Each wrapper runs on CPU tensors with its kernel replaced by a recorder; every distinct launch is then compiled
the way ``kernel[grid](...)`` would on an sm_90 GPU (the JIT's own specialization: integer 1 as a constant,
16-divisible integers and pointers marked so). Covered: every entry of the tile tables
(``layers/quant_tiles.py``) at the row counts they serve, bf16 / fp16 / fp32 activations, bias or none, split K,
the W8A16 activation modes (per token in the kernel, the default; pre-quantized e4m3; none), on Llama-3.1-8B
projection shapes; with ``--sweep``, every configuration ``benchmarks/quant_gemm_gpu.py`` times.
Prints registers and spills (ptxas -v) per variant.

    PYTHONPATH=. python tests/unit/quant_compile_check.py [--arch 90] [--quick] [--sweep]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JITFunctions, not interpreted ones

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from specserve.layers import (  # noqa: E402
    quant_tiles,
    triton_fused_mlp,
    triton_gemm,
    triton_gemv,
    triton_pdl,
    triton_w4a16,
    triton_w8a16,
)
from specserve.layers.quant_gpu import quantize_fp8_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ((triton_w8a16, "_w8a16_kernel"), (triton_w8a16, "_quantize_fp8_rows_kernel"),
           (triton_w4a16, "_w4a16_kernel"), (triton_gemv, "_gemv_kernel"), (triton_gemm, "_gemm_kernel"),
           (triton_fused_mlp, "_fused_mlp_kernel"))


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch instead of running it."""

    def __init__(self, fn, launches: list) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, dict(kwargs)))


def record(calls) -> list:
    """Run ``calls()`` with every kernel replaced by a recorder; returns the launches."""
    launches: list = []
    saved = [(module, name, getattr(module, name)) for module, name in KERNELS]
    try:
        for module, name, fn in saved:
            setattr(module, name, Recorder(fn, launches))
        calls()
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
    return launches


def ptxas_usage(ptx: str, arch: int) -> str:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return "ptxas -v: n/a"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        res = subprocess.run([str(ptxas), f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}", "-v", f.name,
                              "-o", os.devnull], capture_output=True, text=True, timeout=300)
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    return f"regs={regs.group(1) if regs else '?'} spill_stores={spills.group(1) if spills else '?'}"


def compile_launches(launches: list, target: GPUTarget, usage: bool) -> tuple[int, list[str]]:
    backend = make_backend(target)
    seen, failures = set(), []
    for fn, args, kwargs in launches:
        if "USE_PDL" in kwargs:  # recorded on CPU (off); compile what a GPU of this target launches
            kwargs = kwargs | triton_pdl.launch_args(triton_pdl.supports_pdl(target.arch // 10))
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        key = (fn.__name__, str(specialization), str(options))
        if key in seen:
            continue
        seen.add(key)
        opts, signature, constexprs, attrs = fn._pack_args(backend, dict(kwargs), bound, specialization, options)
        named = {fn.arg_names[path[0]]: v for path, v in constexprs.items() if fn.params[path[0]].is_constexpr}
        start = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                      options=opts.__dict__)
        except Exception as exc:  # noqa: BLE001 - report every failing variant, then fail
            failures.append(f"{fn.__name__} {named} {options}: {type(exc).__name__}: {str(exc)[-800:]}")
            print(f"FAILED {failures[-1]}", flush=True)
            continue
        extra = ptxas_usage(compiled.asm["ptx"], target.arch) if usage else ""
        print(f"{fn.__name__:26s} {named} warps={kwargs.get('num_warps')} stages={kwargs.get('num_stages')} "
              f"shared={compiled.metadata.shared} B {extra} ({time.perf_counter() - start:.1f} s)", flush=True)
    return len(seen), failures


SHAPES = ((6144, 4096), (4096, 14336))  # (N, K): Llama-3.1-8B qkv and down projections


def table_calls(quick: bool):
    """Every tile-table entry at the row counts it serves, plus forced split-K, for both kernels."""
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    w8_rows = (1, 2, 3, 4, 8, 16, 32, 64)
    w4_rows = (1, 3, 16, 32, 64, 256) if quick else (1, 2, 3, 4, 16, 17, 32, 48, 64, 200, 256, 4096)

    def calls() -> None:
        gen = torch.Generator().manual_seed(0)
        for n, k in SHAPES[:1] if quick else SHAPES:
            w8, w8_scale = quantize_fp8_rows(torch.randn(n, k, generator=gen) * 0.02)
            qweight = torch.zeros(k // 8, n, dtype=torch.int32)
            for dtype in dtypes:
                bias = torch.zeros(n, dtype=dtype)
                groups = torch.ones(k // 128, n, dtype=dtype)
                for m in w8_rows:
                    x = torch.zeros(m, k, dtype=dtype)
                    triton_w8a16.w8a16_linear(x, w8, w8_scale, None)
                    triton_w8a16.w8a16_linear(x, w8, w8_scale, bias)
                    cfg = quant_tiles.W8A16_TILES.lookup(m, n, k)
                    triton_w8a16.w8a16_linear(x, w8, w8_scale, None, config=_replace(cfg, split_k=3))
                    for act_quant in ("none", "per_token_prequant"):
                        triton_w8a16.w8a16_linear(x, w8, w8_scale, bias, act_quant=act_quant)
                    for prefetch in (1, 2) if cfg.use_dot else ():  # weight tiles loaded before the PDL wait
                        triton_w8a16.w8a16_linear(x, w8, w8_scale, None, config=_replace(cfg, prefetch=prefetch),
                                                  act_quant="per_token_prequant")
                for m in w4_rows:
                    x = torch.zeros(m, k, dtype=dtype)
                    triton_w4a16.w4a16_linear(x, qweight, groups, groups, None)
                    triton_w4a16.w4a16_linear(x, qweight, groups, groups, bias)
                    triton_w4a16.w4a16_linear(x, qweight, groups, groups, None, split_k=1)
                    triton_w4a16.w4a16_linear(x, qweight, groups, groups, None, split_k=4)
                for m in (1, 33):
                    triton_w8a16.quantize_fp8_rows_triton(torch.zeros(m, k, dtype=dtype))
        for n, k in quant_tiles.W8A16_TILES.by_shape:  # per-shape entries, on the e4m3 activations of the engine
            w8 = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
            for m in w8_rows:
                x_q, x_scale = torch.zeros(m, k, dtype=torch.float8_e4m3fn), torch.ones(m, 1)
                triton_w8a16.w8a16_linear(x_q, w8, torch.ones(n), None, act_quant="per_token_prequant",
                                          x_scale=x_scale, out_dtype=torch.bfloat16)
                if dtype in triton_gemv.GEMV_DTYPES:
                    w16 = torch.zeros(n, k, dtype=dtype)
                    for m in (1, 2, 3, 4):
                        x = torch.zeros(m, k, dtype=dtype)
                        triton_gemv.gemv_linear(x, w16, None)
                        triton_gemv.gemv_linear(x, w16, bias)
                        cfg = quant_tiles.BF16_GEMV_TILES.lookup(m, n, k)
                        triton_gemv.gemv_linear(x, w16, None, config=_replace(cfg, split_k=3))
                        triton_gemv.gemv_linear(x[:, :k - 8], w16[:, :k - 8].contiguous(), None)  # ragged K
        hidden, inter = 4096, 14336  # the persistent FP8 MLP block at one row, Llama-3.1-8B, 132 programs
        x1 = torch.zeros(1, hidden, dtype=torch.bfloat16)
        w_gu = torch.zeros(2 * inter, hidden, dtype=torch.float8_e4m3fn)
        w_d = torch.zeros(hidden, inter, dtype=torch.float8_e4m3fn)
        tilings = load_benchmark("persistent_mlp_gpu").TILINGS  # the ones it times (programs per SM aside)
        for bn1, bk1, bn2, bk2, warps, stages, _ in tilings[:1] if quick else tilings:
            for act_quant in (True, False):
                triton_fused_mlp.fused_mlp_fp8(x1, x1, x1[0], w_gu, torch.ones(2 * inter), w_d, torch.ones(hidden),
                                               1e-5, torch.zeros(1, dtype=torch.int32), 132,
                                               amax=torch.zeros(2, dtype=torch.int32), act_quant=act_quant, bn1=bn1,
                                               bk1=bk1, bn2=bn2, bk2=bk2, num_warps=warps, stages=stages)
        for (n, k), buckets in quant_tiles.BF16_GEMM_TILES.items():  # per-shape tensor-core GEMM entries
            w16 = torch.zeros(n, k, dtype=torch.bfloat16)
            for m, cfg in buckets.items():
                if cfg is not None:
                    x = torch.zeros(m, k, dtype=torch.bfloat16)
                    triton_gemm.gemm_linear(x, w16, None, config=cfg)
                    triton_gemm.gemm_linear(x, w16, None, config=cfg, out_dtype=torch.float32)
                    triton_gemm.gemm_linear(x, w16, None, config=_replace(cfg, tma=not cfg.tma))
    return calls


def _replace(cfg, **fields):
    import dataclasses
    return dataclasses.replace(cfg, **fields)


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (its sweeps are the configurations to compile)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sweep_calls():
    """Every configuration the GPU benchmark sweeps, at its row counts, bf16, on the qkv shape."""
    bench = load_benchmark("quant_gemm_gpu")

    def calls() -> None:
        n, k = SHAPES[0]
        w8, w8_scale = quantize_fp8_rows(torch.randn(n, k) * 0.02)
        qweight = torch.zeros(k // 8, n, dtype=torch.int32)
        groups = torch.ones(k // 128, n, dtype=torch.bfloat16)
        for m in bench.DEFAULT_ROWS:
            x = torch.zeros(m, k, dtype=torch.bfloat16)
            for cfg in bench.w8a16_sweep(m):
                triton_w8a16.w8a16_linear(x, w8, w8_scale, None, config=cfg)
            for cfg in bench.w4a16_sweep(m):
                triton_w4a16.w4a16_linear(x, qweight, groups, groups, None, config=cfg)
            w16 = torch.zeros(n, k, dtype=torch.bfloat16)
            for cfg in bench.bf16_gemv_sweep(m):
                triton_gemv.gemv_linear(x, w16, None, config=cfg)
        spec = importlib.util.spec_from_file_location("triton_gemm_gpu", ROOT / "benchmarks" / "triton_gemm_gpu.py")
        gemm_bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gemm_bench)
        x, w16 = torch.zeros(256, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.bfloat16)
        for cfg in gemm_bench.gemm_sweep():  # the tensor-core GEMM's sweep, bf16 and float32 (LM head) output
            triton_gemm.gemm_linear(x, w16, None, config=cfg)
            triton_gemm.gemm_linear(x, w16, None, config=cfg, out_dtype=torch.float32)
    return calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    ap.add_argument("--quick", action="store_true", help="bf16 and the qkv shape only")
    ap.add_argument("--sweep", action="store_true", help="also every configuration the GPU benchmark sweeps")
    ap.add_argument("--no-usage", action="store_true", help="skip ptxas -v (registers, spills)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    launches = record(table_calls(args.quick))
    if args.sweep:
        launches += record(sweep_calls())
    n, failures = compile_launches(launches, GPUTarget("cuda", args.arch, 32), not args.no_usage)
    print(f"{n} quantized-kernel variants compiled for sm_{args.arch} in {time.perf_counter() - start:.0f} s, "
          f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
