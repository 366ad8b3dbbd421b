"""Decode / verify attention launch settings swept on the GPU (GPU machine, not CI): keys per tile, warps, pipeline
stages and split-KV count of ``TritonAttentionBackend``'s decode kernel, per (batch, context, query length), on
the Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim 128) or SmolLM2-135M's (9, 3, 64), bf16,
block_size 16, shuffled blocks.

Unlike ``attention_gpu.py`` (one layer replayed over and over, whose KV may sit in L2 at small batch), each
measurement replays a CUDA graph of one forward per *copy* of the KV cache, with enough copies (>= 400 MB of KV in
all, at least 4) that every layer's keys and values stream from HBM, as in a step of a many-layer model. Reported
per layer: microseconds, the KV bytes read over that time (TB/s), and each setting's speed-up over the engine's
current choice (``graph_num_splits`` for the batch, default tiles). Every setting's output is checked against the
current choice's (max |diff| <= 2e-2, bf16).

    python benchmarks/attention_sweep_gpu.py --out $OUT/attention_sweep_gpu.json
    python benchmarks/attention_sweep_gpu.py --shape smollm2 --cases 1x2048x1,8x512x1 --out $OUT/smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from benchmarks.attention_gpu import BLOCK_SIZE, make_batch, own_meta, split_qkv  # noqa: E402
from specserve.layers.triton_attention import TritonAttentionBackend  # noqa: E402

SHAPES = {"llama8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # (query heads, kv heads, head_dim)
CASES = "1x2048x1,1x8192x1,8x512x1,8x2048x1,8x8192x1,32x512x1,32x512x8,32x2048x1,64x2048x1"  # batch x context x q


def settings(default_splits: int) -> list[dict]:
    splits = sorted({s for s in (default_splits // 2, default_splits, 2 * default_splits, 4 * default_splits)
                     if 1 <= s <= 32})
    return [{"decode_block_n": bn, "decode_warps": w, "decode_stages": st, "num_splits": sp}
            for bn in (64, 128) for w in (4, 8) for st in (2, 3, 4) for sp in splits]


def time_graph(backend: TritonAttentionBackend, meta, q, k, v, caches) -> tuple[float, torch.Tensor]:
    """(microseconds per forward: a graph of one forward per cache copy (ge.graph_time_s), the output of one)."""
    meta = own_meta(meta)
    backend.prepare(meta, BLOCK_SIZE)
    out = backend.forward(q, k, v, *caches[0], meta).clone()

    def body() -> None:
        for kc, vc in caches:
            backend.forward(q, k, v, kc, vc, meta)
    return ge.graph_time_s(body) * 1e6 / len(caches), out


def run_case(shape: str, batch: int, context: int, query_len: int) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape]
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(batch * 100003 + context + query_len)
    meta, qkv32, k32, v32 = make_batch(heads, kv_heads, head_dim, batch, context, query_len, gen, device)
    q, k, v = split_qkv(qkv32.bfloat16(), heads, kv_heads, head_dim)
    seq_len = context + query_len
    kv_bytes = batch * seq_len * kv_heads * head_dim * 2 * 2  # K and V read per layer, bf16
    cache_bytes = k32.numel() * 2 * 2
    copies = max(4, -(-400_000_000 // cache_bytes))
    caches = [(k32.bfloat16(), v32.bfloat16()) for _ in range(copies)]
    del k32, v32
    default_splits = TritonAttentionBackend().graph_num_splits(batch, kv_heads, device)
    base_us, base_out = time_graph(TritonAttentionBackend(num_splits=default_splits), meta, q, k, v, caches)
    row = {"shape": shape, "batch": batch, "context": context, "query_len": query_len, "copies": copies,
           "kv_mb": kv_bytes / 1e6,
           "current": {"num_splits": default_splits, "us": base_us, "tb_s": kv_bytes / base_us / 1e6},
           "settings": []}
    for s in settings(default_splits):
        try:
            us, out = time_graph(TritonAttentionBackend(**s), meta, q, k, v, caches)
            diff = (out.float() - base_out.float()).abs().max().item()
            row["settings"].append(s | {"us": us, "tb_s": kv_bytes / us / 1e6, "speedup": base_us / us,
                                        "max_diff": diff, "ok": diff <= 2e-2})
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: record, go on
            row["settings"].append(s | {"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    ok = [r for r in row["settings"] if r.get("ok")]
    row["best"] = min(ok, key=lambda r: r["us"]) if ok else None
    del caches
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--cases", default=CASES, help="comma-separated batch x context x query_len")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "attention_sweep_gpu.json"))
    args = ap.parse_args()
    out = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "definitions": {"us": "microseconds per layer's attention forward (KV write + decode kernel + split "
                                 "combine) in a CUDA graph over HBM-resident KV copies",
                           "tb_s": "K and V bytes of the layer / us", "speedup": "current us / setting us"},
           "cases": []}
    start = time.perf_counter()
    out["shape"] = args.shape
    for case in args.cases.split(","):
        batch, context, query_len = (int(v) for v in case.split("x"))
        row = run_case(args.shape, batch, context, query_len)
        out["cases"].append(row)
        best = row["best"]
        print(f"b={batch:<3d} ctx={context:<5d} q={query_len}: current {row['current']['us']:7.1f} us "
              f"({row['current']['tb_s']:.2f} TB/s, {row['current']['num_splits']} splits)  best "
              + (f"{best['us']:7.1f} us ({best['tb_s']:.2f} TB/s) x{best['speedup']:.3f} bn={best['decode_block_n']} "
                 f"w={best['decode_warps']} st={best['decode_stages']} splits={best['num_splits']}" if best else "-"),
              flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    out["total_seconds"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
