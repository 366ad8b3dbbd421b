"""The Triton tensor-core GEMM (``layers/triton_gemm.py``) against cuBLAS at verify row counts, then in the engine
(GPU machine, not CI). One run, two parts:

1. Per Llama-3.1-8B weight shape (qkv, o, gate_up, down; the LM head with float32 output) and row count (128, 256
   by default): cuBLAS (``F.linear`` / ``torch.mm(out_dtype=float32)``, as ``dense_linear`` calls it) and every
   configuration of ``gemm_sweep()``, each timed the same way: a CUDA graph of ``--reps`` x (one call on each of
   several weight copies, enough copies to hold >= 400 MB so the weights stream from HBM as in a forward, not from
   L2), median of 5 replays, per call. The best configuration per (shape, M) is checked against an fp32 reference.
2. The step A/B (``pdl_gpu.run_case``: graph-replayed target forward + LM head, graphs captured afresh per setting,
   ``--rounds`` alternations): "cublas" (``BF16_GEMM_TILES`` empty, the default) against "triton" (the table
   built from part 1: every (shape, M) whose best configuration beat cuBLAS by ``--min-gain``), for decode (q = 1)
   and verify (q = 4, 8) steps at batch 32, plus issue 6's figure verify8 / decode for both settings.

Asserts nothing; prints tables, the suggested ``BF16_GEMM_TILES`` entries, and writes JSON.

    python benchmarks/triton_gemm_gpu.py --out $OUT/triton_gemm_gpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
import benchmarks.pdl_gpu as pdl_gpu  # noqa: E402
from specserve.config import CacheConfig  # noqa: E402
from specserve.engine.model_runner import ModelRunner  # noqa: E402
from specserve.layers import quant_tiles, triton_gemm  # noqa: E402
from specserve.layers.quant_tiles import TileConfig  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402

# (block_m, block_n, block_k, num_warps, num_stages): Hopper-sized tiles, each with pointer loads and with TMA
_TILES = ((128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (256, 128, 64, 8, 4),
          (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 5), (128, 128, 128, 8, 3),
          (64, 128, 64, 4, 4), (64, 128, 64, 4, 6), (64, 256, 64, 4, 4), (64, 256, 64, 8, 4),
          (64, 128, 128, 4, 4), (128, 64, 64, 4, 4), (128, 64, 128, 4, 4), (64, 64, 128, 4, 5), (64, 64, 64, 4, 6))


def gemm_sweep() -> list[TileConfig]:
    return [TileConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=s, block_m=bm, tma=tma)
            for tma in (False, True) for bm, bn, bk, w, s in _TILES]


def llama8b_shapes() -> dict[str, tuple[int, int, bool]]:
    """name -> (N, K, float32 output) of Llama-3.1-8B's weights."""
    c = shape_config("llama-3.1-8b")
    head_dim = c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim
    return {"qkv": (qkv, c.hidden_size, False), "o": (c.hidden_size, c.hidden_size, False),
            "gate_up": (2 * c.intermediate_size, c.hidden_size, False),
            "down": (c.hidden_size, c.intermediate_size, False), "lm_head": (c.vocab_size, c.hidden_size, True)}


def time_calls(calls: list, reps: int) -> float:
    """Seconds per call: a CUDA graph of ``reps`` passes over ``calls`` (ge.graph_time_s)."""
    def body() -> None:
        for _ in range(reps):
            for call in calls:
                call()
    return ge.graph_time_s(body) / (reps * len(calls))


def gemm_operands(n: int, k: int, m: int, device: torch.device, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """bf16 operands of ``x @ w.T`` drawn from one generator seeded ``seed``: as many [n, k] weight copies as hold
    >= 400 MB (so a pass over them streams from HBM, not L2), then x [m, k]."""
    copies = max(1, -(-400_000_000 // (n * k * 2)))
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies)]
    return weights, torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)


def sweep_shape(n: int, k: int, float_out: bool, m: int, device: torch.device, reps: int) -> dict:
    weights, x = gemm_operands(n, k, m, device, n + k + m)
    copies = len(weights)
    out_dtype = torch.float32 if float_out else None

    def cublas(w):
        return (lambda: torch.mm(x, w.t(), out_dtype=torch.float32)) if float_out else (lambda: F.linear(x, w))

    row = {"n": n, "k": k, "m": m, "copies": copies, "float_out": float_out}
    row["cublas_us"] = time_calls([cublas(w) for w in weights], reps) * 1e6
    configs = {}
    for cfg in gemm_sweep():
        try:
            configs[cfg.describe()] = time_calls(
                [lambda w=w, c=cfg: triton_gemm.gemm_linear(x, w, config=c, out_dtype=out_dtype) for w in weights],
                reps) * 1e6
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: record it, time the others
            configs[cfg.describe()] = f"{type(exc).__name__}: {str(exc)[:200]}"
    timed = {d: t for d, t in configs.items() if isinstance(t, float)}
    best = min(timed, key=timed.get)
    row |= {"configs_us": configs, "best": best, "best_us": timed[best],
            "speedup_vs_cublas": row["cublas_us"] / timed[best],
            "tflop_s": {"cublas": 2 * m * n * k / row["cublas_us"] / 1e6, "best": 2 * m * n * k / timed[best] / 1e6}}
    cfg = next(c for c in gemm_sweep() if c.describe() == best)
    ref = x.float() @ weights[0].float().t()
    got = triton_gemm.gemm_linear(x, weights[0], config=cfg, out_dtype=out_dtype).float()
    row["best_max_rel_err"] = ((got - ref).abs().max() / ref.abs().max()).item()
    del weights
    ge.free(device)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="128,256")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--min-gain", type=float, default=1.03, help="table entries need this speedup over cuBLAS")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--table-out", default=None, help="also write the suggested table as JSON (gpu_engine.py "
                                                       "--bf16-gemm-table reads it)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "triton_gemm_gpu.json"))
    args = ap.parse_args()
    device = torch.device("cuda")
    out = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
           "torch": torch.__version__, "definitions": {
               "cublas_us / configs_us": "microseconds per call inside a CUDA graph of back-to-back calls over "
                                         "weight copies (>= 400 MB in all: HBM, not L2)",
               "step_s": "pdl_gpu.run_case: median graph-replayed target forward + LM head per setting",
               "verify_vs_decode": "step_s at q = 8 / step_s at q = 1, batch 32, same setting (issue 6's "
                                   "verify8_vs_decode_b32, here from this script's own A/B)"},
           "gemm": [], "table": {}, "engine": []}
    start = time.perf_counter()
    rows = [int(r) for r in args.rows.split(",")]
    table: dict[tuple[int, int], dict[int, TileConfig | None]] = {}
    for name, (n, k, float_out) in llama8b_shapes().items():
        for m in rows:
            row = {"name": name} | sweep_shape(n, k, float_out, m, device, args.reps)
            out["gemm"].append(row)
            win = row["speedup_vs_cublas"] >= args.min_gain
            table.setdefault((n, k), {})[m] = (next(c for c in gemm_sweep() if c.describe() == row["best"])
                                               if win else None)
            print(f"{name:8s} m={m:<4d} cublas {row['cublas_us']:8.1f} us  best {row['best_us']:8.1f} us "
                  f"x{row['speedup_vs_cublas']:.3f}  {row['best']}  err {row['best_max_rel_err']:.1e}", flush=True)
            Path(args.out).write_text(json.dumps(out, indent=2))
    table = {key: v for key, v in table.items() if any(c is not None for c in v.values())}
    out["table"] = {f"{n}x{k}": {m: (c.describe() if c else None) for m, c in v.items()} for (n, k), v in table.items()}
    if args.table_out:
        Path(args.table_out).write_text(json.dumps(
            {f"{n},{k}": {str(m): (dataclasses.asdict(c) if c else None) for m, c in v.items()}
             for (n, k), v in table.items()}, indent=1))
    print("suggested BF16_GEMM_TILES:")
    for (n, k), v in table.items():
        print(f"    ({n}, {k}): {{" + ", ".join(f"{m}: {c.describe() if c else None}" for m, c in v.items()) + "},")
    if not args.skip_engine and table:
        pdl_gpu.SETTINGS = {"cublas": {(quant_tiles, "BF16_GEMM_TILES"): {}},
                            "triton": {(quant_tiles, "BF16_GEMM_TILES"): table}}
        config = shape_config("llama-3.1-8b")
        model = ge.dummy_model(config, 2048, torch.bfloat16, device)
        runner = ModelRunner(model, config, CacheConfig(block_size=ge.BLOCK_SIZE, kv_cache_memory_gib=args.kv_gib),
                             device)
        for batch, query_len in ((32, 1), (32, 8), (32, 4)):
            row = {"batch": batch, "query_len": query_len}
            try:
                row |= pdl_gpu.run_case(runner, device, batch, query_len, args.context, args.iters, args.rounds)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            out["engine"].append(row)
            print(row.get("error") or (f"b={batch:<3d} q={query_len}: " + "  ".join(
                f"{s} {t * 1e3:.3f} ms" for s, t in row["step_s"].items())
                + "  x" + " x".join(f"{v:.3f}" for v in row["speedup_vs_base"].values())), flush=True)
            Path(args.out).write_text(json.dumps(out, indent=2))
        quant_tiles.BF16_GEMM_TILES = {}
        steps = {(r["batch"], r["query_len"]): r.get("step_s") for r in out["engine"]}
        if steps.get((32, 1)) and steps.get((32, 8)):
            out["verify_vs_decode"] = {s: steps[(32, 8)][s] / steps[(32, 1)][s] for s in steps[(32, 1)]}
            print("verify8 / decode at batch 32:", out["verify_vs_decode"])
    out["total_seconds"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
