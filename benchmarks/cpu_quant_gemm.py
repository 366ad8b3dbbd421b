"""CPU GEMM from GGUF blocks (specserve/kernels/cpu_quant_gemm.cpp) vs fp32 oneDNN-packed and plain F.linear.

Shapes are SmolLM2-135M's projections (hidden 576, FFN 1536; fused q|k|v is 960 x 576, fused gate|up 3072 x 576)
and its Q8_0 tied LM head (49152 x 576), at M = 1, 5, 8 rows by default (a decode step, a verify step of one
request at num_spec_tokens 4, a batch of 8; ``--rows`` picks others). The quantized kernel runs twice, A/B: with
float32 activations (the default, ``quant``) and with activations quantized per block of 32 to int8
(``--cpu-activation-quant q8``, ``quant_q8``). Two regimes:
  cold: each call uses the next of several weight copies, together larger than the last-level cache, as in a
        real decode step where every weight is streamed from DRAM once (the number that matters);
  hot:  the same weight every call (fits in L3 for the small shapes; an upper bound).
Reports the median time of one call (mean in the JSON), and the weight bytes per second it implies.

    .venv/bin/python benchmarks/cpu_quant_gemm.py [--threads 2] [--repeats 7] [--rows 1,5,8]

``--shapes head``: the shipped EAGLE-3 head's projections in Q8_0 (``SpecConfig.head_cpu_quant``: lm_head 32768 x
576, gate|up 12288 x 576, down 576 x 6144, fc 576 x 1728, q|k|v 960 x 1152), the rows a draft step has (1 per
drafting request; the first step of a round also ingests the verified tokens), which sets
``eagle_head.HEAD_QUANT_MAX_ROWS``:

    .venv/bin/python benchmarks/cpu_quant_gemm.py --shapes head --rows 1,4,8,16,32 --repeats 5 \
        --out benchmarks/results/cpu_head_gemm.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.bench.machine import machine_info as machine  # noqa: E402
from specserve.layers.quant_cpu import BLOCK_BYTES, QuantizedWeight, load_extension, quant_linear  # noqa: E402

SHAPES = [("q4_1", 3072, 576), ("q4_1", 576, 1536), ("q4_1", 960, 576), ("q4_1", 576, 576), ("q8_0", 49152, 576)]
HEAD_SHAPES = [("q8_0", 32768, 576), ("q8_0", 12288, 576), ("q8_0", 576, 6144), ("q8_0", 576, 1728),
               ("q8_0", 960, 1152)]
ROWS = "1,5,8"
COLD_BYTES = 192 << 20  # fp32 weight copies per shape add up to at least this (> 32 MiB L3, x6)


def random_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:  # [n, row_bytes] uint8
    groups, block_bytes = k // 32, BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(n, groups, block_bytes), dtype=np.uint8)
    raw[..., 0:2] = rng.uniform(1e-3, 5e-2, size=(n, groups, 1)).astype(np.float16).view(np.uint8)
    if qtype == "q4_1":
        raw[..., 2:4] = rng.uniform(-0.3, 0.3, size=(n, groups, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, groups * block_bytes)


def time_per_call(fn, args_list: list, repeats: int, min_seconds: float = 0.05) -> tuple[float, float]:
    """(median, mean) seconds of one call, cycling through args_list; each call is timed on its own, so the median
    ignores the multi-millisecond stalls other tenants of a shared 2-core machine cause (the mean keeps them)."""
    for args in args_list:  # warm up (and fault in) every copy
        fn(*args)
    samples = []
    i = 0
    for _ in range(repeats):
        round_start = time.perf_counter()
        while time.perf_counter() - round_start < min_seconds or i % len(args_list):
            start = time.perf_counter()
            fn(*args_list[i % len(args_list)])
            samples.append(time.perf_counter() - start)
            i += 1
    return statistics.median(samples), statistics.fmean(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", default=ROWS, help="comma-separated row counts M")
    parser.add_argument("--shapes", choices=["target", "head"], default="target",
                        help="SmolLM2's own projections (target) or the shipped EAGLE-3 head's in Q8_0 (head)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "cpu_quant_gemm.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = load_extension()
    if ext is None:
        print("the quantized kernel did not build; nothing to measure", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    rows = []
    header = (f"{'qtype':5} {'N':>6} {'K':>5} {'M':>3} {'regime':6} | {'quant us':>9} {'GB/s':>5} | "
              f"{'q8 act us':>9} {'fp32/q8':>7} | {'packed us':>9} {'GB/s':>5} | {'F.linear us':>11} | "
              f"{'packed/quant':>12}")
    print(header)
    print("-" * len(header))
    for qtype, n, k in (HEAD_SHAPES if args.shapes == "head" else SHAPES):
        fp32_bytes = n * k * 4
        copies = max(1, min(64, math.ceil(COLD_BYTES / fp32_bytes)))
        quant = [QuantizedWeight.from_gguf_bytes(random_blocks(rng, qtype, n, k), qtype, n, k) for _ in range(copies)]
        dense = [w.dequantize() for w in quant]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in dense]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            for regime, count in (("cold", copies), ("hot", 1)):
                t_quant, mean_quant = time_per_call(quant_linear, [(x, w) for w in quant[:count]], args.repeats)
                t_q8, mean_q8 = time_per_call(quant_linear, [(x, w, None, "q8") for w in quant[:count]],
                                              args.repeats)
                t_packed, mean_packed = time_per_call(
                    lambda x_, w_: torch.ops.mkldnn._linear_pointwise(x_, w_, None, "none", [], ""),
                    [(x, w) for w in packed[:count]], args.repeats)
                t_linear, mean_linear = time_per_call(F.linear, [(x, w) for w in dense[:count]], args.repeats)
                row = {"qtype": qtype, "N": n, "K": k, "M": m, "regime": regime, "weight_copies": count,
                       "quant_bytes": quant[0].nbytes, "fp32_bytes": fp32_bytes,
                       "quant_us": t_quant * 1e6, "quant_q8_us": t_q8 * 1e6,
                       "fp32_act_over_q8_act": t_quant / t_q8,
                       "packed_fp32_us": t_packed * 1e6, "linear_fp32_us": t_linear * 1e6,
                       "quant_mean_us": mean_quant * 1e6, "quant_q8_mean_us": mean_q8 * 1e6,
                       "packed_fp32_mean_us": mean_packed * 1e6,
                       "linear_fp32_mean_us": mean_linear * 1e6,
                       "quant_GBps": quant[0].nbytes / t_quant / 1e9, "packed_fp32_GBps": fp32_bytes / t_packed / 1e9}
                rows.append(row)
                print(f"{qtype:5} {n:6} {k:5} {m:3} {regime:6} | {row['quant_us']:9.1f} {row['quant_GBps']:5.1f} | "
                      f"{row['quant_q8_us']:9.1f} {t_quant / t_q8:6.2f}x | "
                      f"{row['packed_fp32_us']:9.1f} {row['packed_fp32_GBps']:5.1f} | {row['linear_fp32_us']:11.1f} | "
                      f"{t_packed / t_quant:11.2f}x")
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
              "kernel_avx2": bool(ext.built_with_avx2()), "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
