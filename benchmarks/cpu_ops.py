"""Fused CPU elementwise ops (specserve/kernels/cpu_ops.cpp) vs the plain torch ops they replace.

SmolLM2-135M shapes: hidden 576, FFN 1536 (gate|up 3072), 9 query + 3 KV heads of 64 (q|k|v row 960, q|k 768),
at N = 1, 8, 32 tokens (decode batch sizes). Each op runs on the same small tensors in a loop (hot caches, as in
a decode step where they come straight out of the previous GEMM); the median time of one call is reported.

    .venv/bin/python benchmarks/cpu_ops.py [--threads 2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.bench.machine import machine_info as machine  # noqa: E402
from specserve.layers import cpu_ops  # noqa: E402

HIDDEN, FFN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, EPS = 576, 1536, 9, 3, 64, 1e-5
ROWS = [1, 8, 32]


def time_per_call(fn, repeats: int, min_seconds: float = 0.05) -> float:
    """Median seconds of one call (each call timed alone: the median ignores stalls from other tenants)."""
    for _ in range(20):
        fn()
    samples = []
    for _ in range(repeats):
        round_start = time.perf_counter()
        while time.perf_counter() - round_start < min_seconds:
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def torch_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    return qk * cos + rotated * sin


def cases(n: int) -> list[tuple[str, object, object]]:
    """(name, torch version, fused version) closures over fresh inputs of n rows."""
    x = torch.randn(n, HIDDEN)
    residual = torch.randn(n, HIDDEN)
    weight = torch.randn(HIDDEN)
    gate_up = torch.randn(n, 2 * FFN)
    qkv = torch.randn(n, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    q = qkv[:, :NUM_HEADS * HEAD_DIM].view(n, NUM_HEADS, HEAD_DIM)
    k = qkv[:, NUM_HEADS * HEAD_DIM:(NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(n, NUM_KV_HEADS, HEAD_DIM)
    qk = qkv[:, :(NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(n, NUM_HEADS + NUM_KV_HEADS, HEAD_DIM)
    cos, sin = torch.randn(n, HEAD_DIM), torch.randn(n, HEAD_DIM)
    cos3, sin3 = cos.unsqueeze(1), sin.unsqueeze(1)
    return [
        ("rms_norm (manual torch)", lambda: torch_rms_norm(x, weight), lambda: cpu_ops.rms_norm(x, weight, EPS)),
        ("rms_norm (F.rms_norm)", lambda: F.rms_norm(x, (HIDDEN,), weight, EPS),
         lambda: cpu_ops.rms_norm(x, weight, EPS)),
        # torch: h = residual + x (out of place, as the model does), then norm; the residual stays untouched here
        ("add + rms_norm", lambda: F.rms_norm(residual + x, (HIDDEN,), weight, EPS),
         lambda: cpu_ops.fused_add_rms_norm(x, residual, weight, EPS)),
        ("silu_and_mul", lambda: F.silu(gate_up[:, :FFN]) * gate_up[:, FFN:], lambda: cpu_ops.silu_and_mul(gate_up)),
        ("rope q and k", lambda: (torch_rope(q, cos3, sin3), torch_rope(k, cos3, sin3)),
         lambda: cpu_ops.rope_rotate_half_(qk, cos, sin)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "cpu_ops.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = cpu_ops.load_ops_extension()
    if ext is None:
        print("the fused CPU ops did not build; nothing to measure", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    rows = []
    header = f"{'op':24} {'N':>3} | {'torch us':>9} | {'fused us':>9} | {'speedup':>7}"
    print(header)
    print("-" * len(header))
    for n in ROWS:
        for name, torch_fn, fused_fn in cases(n):
            t_torch = time_per_call(torch_fn, args.repeats)
            t_fused = time_per_call(fused_fn, args.repeats)
            rows.append({"op": name, "N": n, "torch_us": t_torch * 1e6, "fused_us": t_fused * 1e6,
                         "speedup": t_torch / t_fused})
            print(f"{name:24} {n:3} | {t_torch * 1e6:9.2f} | {t_fused * 1e6:9.2f} | {t_torch / t_fused:6.2f}x")
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
              "kernel_avx2": bool(ext.built_with_avx2()), "shapes": {"hidden": HIDDEN, "ffn": FFN,
                                                                     "num_heads": NUM_HEADS,
                                                                     "num_kv_heads": NUM_KV_HEADS,
                                                                     "head_dim": HEAD_DIM},
              "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
