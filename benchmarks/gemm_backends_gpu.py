"""cuBLAS against cuBLASLt (``torch.backends.cuda.preferred_blas_library``) on the Llama-3.1-8B projections at the
row counts of decode and verify steps (GPU machine, not CI; a diagnostic for issue 6's verify bar, whose extra
cost over decode is the bf16 GEMMs at 256 rows).

For each backend, shape (qkv, o, gate_up, down, lm_head) and M: the median of CUDA-event-timed CUDA-graph replays
of 20 back-to-back ``F.linear`` calls (weights larger than L2, so each call streams its weight), per call, and the
TFLOP/s that makes.

    python benchmarks/gemm_backends_gpu.py --out $OUT/gemm_backends.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # (N, K)


def time_linear(x: torch.Tensor, w: torch.Tensor, float_out: bool, calls: int = 20, reps: int = 10) -> float:
    def body() -> None:
        for _ in range(calls):
            if float_out:
                torch.mm(x, w.t(), out_dtype=torch.float32)
            else:
                F.linear(x, w)
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / calls)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", "/tmp")) / "gemm_backends.json"))
    ap.add_argument("--rows", default="32,128,256")
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    out: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
                 "torch": torch.__version__, "us": {}, "tflops": {}, "errors": {}}
    gen = torch.Generator(device=device).manual_seed(0)
    for backend in ("cublas", "cublaslt"):
        try:
            torch.backends.cuda.preferred_blas_library(backend)
        except Exception as exc:  # noqa: BLE001 - record and go on
            out["errors"][backend] = f"{type(exc).__name__}: {exc}"
            continue
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16)
            for m in rows:
                x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
                key = f"{backend}.{name}.m{m}"
                try:
                    t = time_linear(x, w, float_out=name == "lm_head")
                except Exception as exc:  # noqa: BLE001
                    out["errors"][key] = f"{type(exc).__name__}: {exc}"
                    continue
                out["us"][key] = t * 1e6
                out["tflops"][key] = 2 * m * n * k / t / 1e12
                print(f"{key:28s} {t * 1e6:8.1f} us {out['tflops'][key]:6.0f} TFLOP/s", flush=True)
            del w
    torch.backends.cuda.preferred_blas_library("cublas")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
