"""Per-shape tile configurations of the FP8 W8A16 kernel at decode row counts: a sweep per Llama-3.1-8B
projection, then the whole FP8 decode step with the winners against the one-tile-for-all table, in one run on one
GPU. GPU machine, not CI.

    python benchmarks/w8a16_shapes_gpu.py --out $OUT/w8a16_shapes_gpu.json

Why: ``W8A16_TILES`` gives every projection the tile with the least summed time over the four shapes (64 x 128,
fp8 MMA), but the shapes differ (qkv and o are 25 and 17 MB, gate_up 117 MB, down 59 MB with K = 14336), and on an
H100 a 32 x 256 tile, not in ``quant_gemm_gpu.py``'s sweep, read down in 22.3 us against 25.4 and qkv in 11.3
against 13.2 at one row (benchmarks/results/fp8_tiles_h100.json), which the bf16 path does not get.

1. ``sweep``: every configuration of ``sweep_configs`` (fp8 MMA on e4m3 activations, the engine's path) per shape
   and row count (``--rows``), microseconds per call from ``quant_gemm_gpu.time_calls`` (a CUDA graph of
   back-to-back calls over rotating weight copies: no call finds its weights in L2), with the largest elementwise
   distance to the table configuration's output relative to that output's largest magnitude (the sum order
   differs; a wrong configuration shows as O(1)).
2. ``picked``: per row bucket of the table (8, 32) and shape, the fastest configuration summed over that bucket's
   swept row counts, kept only when it beats the table's by ``--min-gain`` (else the table's): the entries of
   ``W8A16_TILES.by_shape``, printed ready to paste.
3. ``step``: whole FP8 decode steps (``fp8_step_ab.py``) with the table as it is (``table``) and with ``picked`` as
   ``by_shape`` overrides (``by_shape``); other tiles change the logits' fp32 sum order only.

Result on an H100 (results/w8a16_shapes_h100.json, which also timed three settings of commit b81dd64 that were
removed after it): the per-shape winners (32 x 256 for down, 32 x 128 for qkv and o at one row; 4-14% faster
alone) made the batch-1 step slower, 3.57 -> 3.63 ms, and batch 8 3.97 -> 4.03, so the table keeps one tile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from benchmarks.fp8_step_ab import add_step_args, fp8_step_ab_args  # noqa: E402
from benchmarks.quant_gemm_gpu import copies, time_calls  # noqa: E402
from specserve.layers import quant_tiles  # noqa: E402
from specserve.layers.quant_gpu import quantize_fp8_rows  # noqa: E402
from specserve.layers.quant_tiles import W8A16_TILES, TileConfig  # noqa: E402
from specserve.layers.triton_splitk import split_counters  # noqa: E402
from specserve.layers.triton_w8a16 import w8a16_linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def sweep_configs(m: int) -> list[TileConfig]:
    """fp8-MMA tiles: 16 to 64 output channels by 128 to 512 of K, 4 or 6 stages, K split to fill the GPU; a
    prefetched first tile (the table's choice up to 8 rows) on the 64 x 128 and 32 x 256 tiles."""
    out = [TileConfig(bn, bk, warps, st, split_k=0, fp8_dot=True)
           for bn in (16, 32, 64) for bk in (128, 256, 512) for st in (4, 6) for warps in (4,)
           if bn * bk * st <= 64 * 512 * 4]
    out += [TileConfig(32, 256, 2, 4, split_k=0, fp8_dot=True), TileConfig(16, 512, 2, 4, split_k=0, fp8_dot=True)]
    if m <= 8:
        out += [TileConfig(64, 128, 4, 4, split_k=0, fp8_dot=True, prefetch=1),
                TileConfig(32, 256, 4, 4, split_k=0, fp8_dot=True, prefetch=1),
                TileConfig(32, 256, 4, 6, split_k=0, fp8_dot=True, prefetch=1)]
    return out


def sweep(out: dict, rows: list[int], device: torch.device, copy_bw: float, launches: int, reps: int) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w_q, w_scale = quantize_fp8_rows(torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16)
                                         / k**0.5)
        w_scale = w_scale.reshape(1, -1).contiguous()
        nbytes = n * k + 4 * n
        sets = copies((w_q,), nbytes, launches)
        counters = split_counters(n, device)
        for m in rows:
            x_q, x_scale = quantize_fp8_rows(torch.randn(m, k, generator=gen, device=device,
                                                         dtype=torch.bfloat16) * 4)
            table = W8A16_TILES.lookup(m, n, k)
            res: dict = {}
            ref = None
            for cfg in [table, *sweep_configs(m)]:
                key = cfg.describe()
                if key in res or n % cfg.block_n:
                    continue

                def call(ws, cfg=cfg, x_q=x_q, x_scale=x_scale, w_scale=w_scale, counters=counters):
                    return w8a16_linear(x_q, ws[0], w_scale, None, config=cfg, counters=counters,
                                        act_quant="per_token_prequant", x_scale=x_scale, out_dtype=torch.bfloat16)
                try:
                    got = call(sets[0]).float()
                    ref = got if ref is None else ref
                    s, how = time_calls([lambda ws=ws, call=call: call(ws) for ws in sets], device, launches, reps)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile is skipped
                    res[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    continue
                res[key] = {"us": s * 1e6, "bw_fraction": nbytes / s / copy_bw, "table": cfg == table,
                            "rel_diff": ((got - ref).abs().max() / ref.abs().max()).item(), "timing": how}
            ok = {c: r for c, r in res.items() if "us" in r}
            best = min(ok, key=lambda c: ok[c]["us"])
            print(f"{name:8s} m={m:2d}: table {ok[table.describe()]['us']:7.2f} us, best {ok[best]['us']:7.2f} us "
                  f"({ok[best]['bw_fraction']:.3f}) {best}", flush=True)
            out.setdefault(name, {})[str(m)] = res
        del sets, w_q
        ge.free(device)


def pick(swept: dict, rows: list[int], min_gain: float) -> dict:
    """{shape: {bucket: describe()}}: per table bucket, the configuration with the least time summed over the
    bucket's swept row counts, if it beats the table's by ``min_gain``."""
    buckets = sorted(W8A16_TILES.by_rows)
    picked: dict = {}
    for name in SHAPES:
        for i, b in enumerate(buckets):
            lo = buckets[i - 1] if i else 0
            ms = [m for m in rows if lo < m <= b]
            if not ms:
                continue
            table = W8A16_TILES.by_rows[b].describe()
            common = set.intersection(*({c for c, r in swept[name][str(m)].items() if "us" in r} for m in ms))
            total = {c: sum(swept[name][str(m)][c]["us"] for m in ms) for c in common}
            best = min(total, key=total.get)
            if table in total and total[best] * (1 + min_gain) > total[table]:
                best = table
            picked.setdefault(name, {})[str(b)] = {"config": best, "us": total[best], "table_us": total.get(table)}
    return picked


def by_shape(picked: dict) -> dict:
    """``pick``'s choices as ``W8A16_TILES.by_shape`` entries (the table's buckets, the picked ones replaced)."""
    timed = {c.describe(): c for m in (1, max(W8A16_TILES.by_rows))  # every configuration the sweep can time
             for c in (*W8A16_TILES.by_rows.values(), *sweep_configs(m))}
    table = {}
    for name, per_bucket in picked.items():
        entry = dict(W8A16_TILES.by_rows)
        entry.update({int(b): timed[p["config"]] for b, p in per_bucket.items()})
        table[SHAPES[name]] = entry
    return table


def step(out: dict, args, picked: dict, device: torch.device) -> None:
    shapes = by_shape(picked)
    fp8_step_ab_args(out, {"table": lambda model: quant_tiles.override(W8A16_TILES, by_shape=None),
                           "by_shape": lambda model: quant_tiles.override(W8A16_TILES, by_shape=shapes)}, device,
                     args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "w8a16_shapes_gpu.json"))
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--min-gain", type=float, default=0.02)
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-step", action="store_true")
    add_step_args(ap, batches="1,8,32")
    args = ap.parse_args(argv)
    rows = [int(m) for m in args.rows.split(",")]
    device = torch.device("cuda")
    rep: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
                 "torch": torch.__version__, "errors": {}, "sweep": {}}
    t0 = time.perf_counter()
    rep["copy_bandwidth_gb_s"] = ge.copy_bandwidth(device, 1 << 30) / 1e9

    def write() -> None:
        rep["total_seconds"] = time.perf_counter() - t0
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rep, indent=1))

    try:
        sweep(rep["sweep"], rows, device, rep["copy_bandwidth_gb_s"] * 1e9, args.launches, args.reps)
        rep["picked"] = pick(rep["sweep"], rows, args.min_gain)
        for name, per_bucket in rep["picked"].items():
            for b, p in per_bucket.items():
                print(f"picked {name} rows <= {b}: {p['config']} ({p['us']:.2f} us, table {p['table_us']})")
        write()
        if not args.no_step:
            rep["step"] = {}
            step(rep["step"], args, rep["picked"], device)
    except Exception as exc:  # noqa: BLE001 - keep what was measured
        rep["errors"]["run"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
        print(f"!!! {exc}", flush=True)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
