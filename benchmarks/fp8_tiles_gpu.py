"""The FP8 (W8A16 kernel) weights in a tile-contiguous layout against the row-major one, on one GPU in one run.
GPU machine, not CI.

    python benchmarks/fp8_tiles_gpu.py --out $OUT/fp8_tiles_gpu.json

Why: at decode sizes a projection streams its weights once, and the FP8 kernel reaches less of the copy bandwidth
than the 16-bit GEMV does (gate_up 91%, down 79%, qkv 62%, o 55% on an H200 at one row, against 100 / 90 / 83 /
71%; benchmarks/results/quant_gemm_fp8dot_gpu.json). Its ``[64, 128]`` tiles read 64 rows of 128 bytes each,
4 KiB apart in a row-major ``[N, 4096]`` weight, while the 16-bit GEMV reads 1 KiB runs. Packed by
``triton_w8a16.pack_weight_tiles``, each tile is one contiguous 8 KiB block and a program's K tiles follow each
other, so every program streams one sequential range. The sums and their order do not change: the outputs must
be equal bit for bit (checked here on the GPU, and in tests/unit/test_triton_quant.py under the interpreter).

Two parts:

- ``gemm``: each Llama-3.1-8B projection (and the LM head) at 1, 8 and 32 rows on e4m3 activations (the engine's
  path), with the tile configuration ``W8A16_TILES`` picks and a few others, both layouts; microseconds per call
  from ``quant_gemm_gpu.time_calls`` (a CUDA graph of back-to-back calls over rotating weight copies, so no call
  finds its weights in L2), GB/s and the fraction of the copy bandwidth.
- ``step``: the FP8 decode step of the dummy Llama-3.1-8B (``gpu_engine.time_decode_steps``: median engine step
  and graph replay) at batch 1 and 8 with the projections' weights row-major and packed, settings alternated
  over ``--rounds`` rounds with graphs captured afresh, plus the bf16 step at batch 1 for the issue-6 ratio
  (``fp8_speedup_b1``), and the logits of one 8-token verify forward under both layouts (must be equal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from benchmarks.quant_gemm_gpu import copies, time_calls  # noqa: E402
from specserve.layers.quant_gpu import Fp8Linear, quantize_fp8_rows  # noqa: E402
from specserve.layers.quant_tiles import W8A16_TILES, TileConfig  # noqa: E402
from specserve.layers.triton_w8a16 import pack_weight_tiles, w8a16_linear  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
EXTRA = {  # configurations beside the table's, by row count
    1: [TileConfig(block_n=128, block_k=128, num_warps=4, num_stages=3, split_k=0, fp8_dot=True),
        TileConfig(block_n=64, block_k=256, num_warps=4, num_stages=3, split_k=0, fp8_dot=True),
        TileConfig(block_n=128, block_k=256, num_warps=4, num_stages=3, split_k=1, fp8_dot=True),
        TileConfig(block_n=32, block_k=256, num_warps=4, num_stages=4, split_k=0, fp8_dot=True)],
    8: [TileConfig(block_n=128, block_k=256, num_warps=4, num_stages=3, split_k=1, fp8_dot=True)],
    32: [],
}
ROWS = (1, 8, 32)


def gemm_part(out: dict, device: torch.device, copy_bw: float, launches: int, reps: int) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w_q, w_scale = quantize_fp8_rows(torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16)
                                         / k**0.5)
        w_scale = w_scale.reshape(1, -1).contiguous()
        nbytes = n * k + 4 * n
        for m in ROWS:
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16) * 4
            x_q, x_scale = quantize_fp8_rows(x)
            table = W8A16_TILES.lookup(m, n, k)
            counters = torch.zeros(4 * (n // 8 + 1), dtype=torch.int32, device=device)
            rows = {}
            for cfg in [table, *EXTRA[m]]:
                if n % cfg.block_n or k % cfg.block_k:
                    continue
                res = {"config": cfg.describe(), "table": cfg == table}
                outs = {}
                for layout in ("row_major", "tiled"):
                    w = w_q if layout == "row_major" else pack_weight_tiles(w_q, cfg.block_n, cfg.block_k)
                    sets = copies((w,), nbytes, launches)

                    def call(ws, cfg=cfg, x_q=x_q, x_scale=x_scale, w_scale=w_scale, counters=counters):
                        return w8a16_linear(x_q, ws[0], w_scale, None, config=cfg, counters=counters,
                                            act_quant="per_token_prequant", x_scale=x_scale,
                                            out_dtype=torch.bfloat16)
                    outs[layout] = call(sets[0]).clone()
                    s, how = time_calls([lambda ws=ws: call(ws) for ws in sets], device, launches, reps)
                    res[layout] = {"us": s * 1e6, "gb_s": nbytes / s / 1e9, "bw_fraction": nbytes / s / copy_bw,
                                   "timing": how}
                    del sets, w
                res["equal"] = bool(torch.equal(outs["row_major"], outs["tiled"]))
                res["speedup"] = res["row_major"]["us"] / res["tiled"]["us"]
                rows[cfg.describe()] = res
                print(f"{name:8s} m={m:2d} {cfg.describe()[:88]:88s} row-major {res['row_major']['us']:7.2f} us "
                      f"({res['row_major']['bw_fraction']:.3f}), tiled {res['tiled']['us']:7.2f} us "
                      f"({res['tiled']['bw_fraction']:.3f}) x{res['speedup']:.3f} equal={res['equal']}", flush=True)
            out.setdefault(name, {})[str(m)] = rows
        del w_q
        ge.free(device)


def set_tiles(model, packed: bool) -> int:
    """Pack (or drop the packed copy of) every FP8 projection's weight whose shape divides into the W8A16 table's
    tile; returns how many were packed."""
    count = 0
    for mod in model.modules():
        if isinstance(mod, Fp8Linear):
            cfg = W8A16_TILES.lookup(1, mod.out_features, mod.in_features)
            fits = mod.out_features % cfg.block_n == 0 and mod.in_features % cfg.block_k == 0
            mod.pack_weight_tiles(cfg.block_n if packed and fits else None, cfg.block_k)
            count += packed and fits
    return count


def step_part(out: dict, args, device: torch.device, dtype: torch.dtype) -> None:
    config = shape_config(args.shape)
    model = ge.dummy_model(config, args.max_model_len, dtype, device)
    engine = ge.engine_for(model, config, device, max(args.batches), 4.0, args.max_model_len, 8192, proposers={})
    r = ge.time_decode_steps(engine, device, 1, args.prompt_len, args.steps)
    out["bf16_b1"] = {k: r[k] for k in ("median_step_s", "graph_replay_s")}
    print(f"bf16 b1: step {r['median_step_s'] * 1e3:.3f} ms, replay {r['graph_replay_s']}", flush=True)
    del engine
    ge.quantize_model(model, "fp8")
    ge.free(device)
    inputs = None
    times: dict = {s: {str(b): {"median_step_s": [], "graph_replay_s": []} for b in args.batches}
                   for s in ("row_major", "tiled")}
    logits = {}
    for _ in range(args.rounds):
        for setting in times:
            out["packed_layers"] = set_tiles(model, setting == "tiled")
            ge.free(device)
            engine = ge.engine_for(model, config, device, max(args.batches), 4.0, args.max_model_len, 8192,
                                   proposers={})
            for b in args.batches:
                r = ge.time_decode_steps(engine, device, b, args.prompt_len, args.steps)
                for key in ("median_step_s", "graph_replay_s"):
                    times[setting][str(b)][key].append(r[key])
                print(f"fp8 {setting} b{b}: step {r['median_step_s'] * 1e3:.3f} ms, replay {r['graph_replay_s']}",
                      flush=True)
            inputs = inputs or ge.forward_inputs(engine.runner, 4, args.prompt_len, 8)
            logits[setting] = ge.logits_of(engine.runner, inputs, graphs=False).float()
            del engine
    set_tiles(model, False)
    med = {s: {b: {k: statistics.median(v) for k, v in r.items() if None not in v} for b, r in t.items()}
           for s, t in times.items()}  # graph_replay_s is None without graphs (CPU)
    out["fp8"] = {"median": med, "runs": times}
    out["tiled_speedup"] = {b: {k: med["row_major"][b][k] / med["tiled"][b][k] for k in med["tiled"][b]}
                            for b in med["tiled"]}
    out["fp8_speedup_b1"] = {s: out["bf16_b1"]["median_step_s"] / med[s]["1"]["median_step_s"] for s in med}
    out["verify_logits_equal"] = bool(torch.equal(logits["row_major"], logits["tiled"]))
    print(json.dumps({k: out[k] for k in ("tiled_speedup", "fp8_speedup_b1", "verify_logits_equal")}, indent=1),
          flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "fp8_tiles_gpu.json"))
    ap.add_argument("--parts", default="gemm,step")
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--shape", default="llama-3.1-8b", help="model shape of the step part")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    device, dtype = torch.device("cuda"), torch.bfloat16
    rep: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
                 "torch": torch.__version__, "errors": {}}
    t0 = time.perf_counter()
    rep["copy_bandwidth_gb_s"] = ge.copy_bandwidth(device, 1 << 30) / 1e9
    parts = args.parts.split(",")
    for part, fn in (("gemm", lambda: gemm_part(rep.setdefault("gemm", {}), device,
                                                rep["copy_bandwidth_gb_s"] * 1e9, args.launches, args.reps)),
                     ("step", lambda: step_part(rep.setdefault("step", {}), args, device, dtype))):
        if part not in parts:
            continue
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - keep what the other part measured
            import traceback
            rep["errors"][part] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
            print(f"!!! {part} failed: {exc}", flush=True)
        rep["total_seconds"] = time.perf_counter() - t0
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

