"""The bf16 GEMMs of a Llama-3.1-8B step at decode (32 rows: batch 32) and verify (256 rows: batch 32 x 8 query
tokens) shapes, under the BLAS settings torch offers, side by side in one run (GPU machine, not CI).

A verify step of 8 tokens per sequence at batch 32 costs 1.46x the decode step (gpu_engine.json), and its GEMMs are
about 80% of it (verify_profile_gpu.json: 6.3 of 7.75 ms of kernels; cuBLAS picks split-K for down_proj at 256 rows
and a 256x128 tile for gate_up, 224 tiles on 132 SMs). This measures whether another cuBLAS / cuBLASLt choice
or reduction setting runs those shapes faster, per shape and summed over a step (32 layers + the LM head).

    python benchmarks/verify_gemm_gpu.py --out $OUT/verify_gemm_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

# (name, in_features, out_features, per step): Llama-3.1-8B, 32 layers
SHAPES = [("qkv", 4096, 6144, 32), ("o", 4096, 4096, 32), ("gate_up", 4096, 28672, 32), ("down", 14336, 4096, 32),
          ("lm_head", 4096, 128256, 1)]


def time_linear(x: torch.Tensor, w: torch.Tensor, reps: int) -> float:  # median seconds of F.linear(x, w)
    for _ in range(5):
        torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.nn.functional.linear(x, w)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="32,256")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {name: torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
               for name, k, n, _ in SHAPES}
    inputs = {(m, k): torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
              for m in rows for _, k, _, _ in SHAPES}
    settings = {
        "default": lambda: None,
        "cublaslt": lambda: torch.backends.cuda.preferred_blas_library("cublaslt"),
        "cublas": lambda: torch.backends.cuda.preferred_blas_library("cublas"),
        "no_reduced_precision_reduction": lambda: setattr(torch.backends.cuda.matmul,
                                                          "allow_bf16_reduced_precision_reduction", False),
    }
    default_blas = torch.backends.cuda.preferred_blas_library()
    default_reduction = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    results: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(0),
                     "torch": torch.__version__,
                     "defaults": {"blas": str(default_blas),
                                  "allow_bf16_reduced_precision_reduction": default_reduction},
                     "by_setting": {}}
    started = time.perf_counter()
    for name, apply in settings.items():
        torch.backends.cuda.preferred_blas_library(default_blas)  # each setting starts from the defaults
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = default_reduction
        apply()
        row: dict = {}
        for m in rows:
            per = {s: time_linear(inputs[(m, k)], weights[s], args.reps) for s, k, _, _ in SHAPES}
            step = sum(per[s] * count for s, _, _, count in SHAPES)
            flops = sum(2 * m * k * n * count for _, k, n, count in SHAPES)
            row[str(m)] = {"per_gemm_us": {s: round(t * 1e6, 2) for s, t in per.items()},
                           "step_ms": round(step * 1e3, 3), "tflop_s": round(flops / step / 1e12, 1)}
        if len(rows) == 2:
            row["verify_vs_decode"] = round(row[str(rows[1])]["step_ms"] / row[str(rows[0])]["step_ms"], 3)
        results["by_setting"][name] = row
        print(name, json.dumps(row), flush=True)
    results["seconds"] = time.perf_counter() - started
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
