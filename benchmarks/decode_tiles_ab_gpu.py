"""End-to-end A/B of the decode kernel's keys per tile and split counts (GPU machine, not CI).

Times whole target forwards + LM head (CUDA graph replays, as the engine's decode and verify steps run) on the
SmolLM2-135M shape (``--shape``; bf16, random weights) with the backend's defaults (labelled None: the rule of
``TritonAttentionBackend.decode_tile_keys`` and automatic split counts) against fixed ``decode_block_n`` values
(``--tile-keys``) and fixed split counts (``--num-splits``, labelled splitsN), one runner each over one model,
in interleaved rounds (``gpu_engine.interleaved_medians``) per (batch, context, query length). Before stop 22
the rule gave 64-wide heads ``block_n`` (64) keys everywhere; the per-layer sweep (benchmarks/
attention_sweep_gpu.py) had found 128 as fast or faster, and the first two runs of this script (``--tile-keys
128`` and ``128,256`` against that rule) set the present one.

    python benchmarks/decode_tiles_ab_gpu.py --out $OUT/decode_tiles_ab_gpu.json --tile-keys 64,128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from specserve.config import CacheConfig, CudaGraphConfig  # noqa: E402
from specserve.engine.model_runner import ModelRunner  # noqa: E402
from specserve.layers.triton_attention import TritonAttentionBackend  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="512,2048,4096")
    ap.add_argument("--query-lens", default="1,4")
    ap.add_argument("--tile-keys", default="128", help="decode_block_n values set against the default (None)")
    ap.add_argument("--num-splits", default="", help="fixed num_splits values set against the default's automatic "
                    "split counts (labelled splitsN), e.g. 32 at batch 1 where auto_splits caps at 16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    device = torch.device("cuda")
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    query_lens = [int(x) for x in args.query_lens.split(",")]
    variants = {None: {}} | {int(x): {"decode_block_n": int(x)} for x in args.tile_keys.split(",") if x}
    variants |= {f"splits{x}": {"num_splits": int(x)} for x in args.num_splits.split(",") if x}
    config = shape_config(args.shape)
    max_len = max(contexts) + max(query_lens) + ge.BLOCK_SIZE
    model = ge.dummy_model(config, max_len, torch.bfloat16, device)
    blocks = max(batches) * -(-max_len // ge.BLOCK_SIZE)
    runners = {}
    for label, kwargs in variants.items():
        runner = ModelRunner(model, config, CacheConfig(block_size=ge.BLOCK_SIZE, num_blocks=blocks), device,
                             TritonAttentionBackend(**kwargs))
        runner.setup_cuda_graphs(CudaGraphConfig(batch_sizes=tuple(batches), capture_at_startup=False), max_len,
                                 max(batches))
        runners[label] = runner
    result = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(0),
              "shape": args.shape, "iters": args.iters, "rounds": args.rounds,
              "default_tile_keys_split_unsplit": [runners[None].backend.decode_tile_keys(config.head_dim, s)
                                                  for s in (2, 1)], "rows": []}
    start = time.perf_counter()
    for b in batches:
        for ctx in contexts:
            for q in query_lens:
                calls = {label: ge.forward_call(r, b, ctx, q) for label, r in runners.items()}
                med = ge.interleaved_medians(calls, device, args.iters, args.rounds)
                row = {"batch": b, "context": ctx, "query_len": q,
                       "step_ms": {str(k): t * 1e3 for k, t in med.items()},
                       "speedup_vs_default": {str(k): med[None] / t for k, t in med.items() if k is not None}}
                result["rows"].append(row)
                print(f"b={b:3d} ctx={ctx:5d} q={q}: " + ", ".join(f"{k}: {t * 1e3:.3f} ms" for k, t in med.items())
                      + "  x" + ", x".join(f"{v:.3f}" for v in row["speedup_vs_default"].values()), flush=True)
    result["seconds"] = round(time.perf_counter() - start, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
