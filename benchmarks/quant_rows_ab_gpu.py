"""Quantized decode and verify steps at 8 to 64 rows on the Llama-3.1-8B shape (dummy weights): the tile tables of
the W8A16 (FP8) and W4A16 (INT4) kernels as committed against variants of their row buckets, with bf16 alongside
(GPU machine, not CI).

FP8: up to 32 rows ``quant_tiles.W8A16_TILES`` multiplies the e4m3 activations on the fp8 MMA (before stop 37 only
up to 8 rows; rows 9 to 32 converted both tiles to fp16 first), and above ``W8A16_MAX_ROWS`` (32) ``Fp8Linear``
runs the fused quantizer + ``torch._scaled_mm``. INT4: ``W4A16_TILES`` (the GEMV up to 4 rows, the tensor cores
above). Methods (``VARIANTS``; a name starting with ``int4`` quantizes to INT4, else FP8):

- ``fp8`` / ``int4``: the tables as committed;
- ``fp8_prev``: the FP8 table before stop 37 (rows 9 to 32 on the fp16-converting MMA; the committed results
  files ``fp8_rows_ab_h100_run*.json`` were taken then, so their ``fp8`` is this and their ``fp8_dot32`` today's);
- ``fp8_dot64``: also rows 33 to 64 through the W8A16 kernel on the fp8 MMA (``W8A16_MAX_ROWS`` 64);
- ``fp8_k256`` / ``fp8_k256_n32``: the tiles ``quant_gemm_gpu.py --rows 16,32,64`` suggested;
- ``fp8_pf0`` / ``fp8_pf1`` / ``fp8_pf2``: the committed FP8 tiles with ``prefetch`` 0 / 1 / 2 at every row count
  up to 32 (each program loads its first weight tiles before the programmatic-dependent-launch wait, overlapping
  the kernel before; the table has 1 up to 8 rows and 0 above, from ``fp8_prefetch_ab_h100_run*.json``, where
  ``fp8`` was today's ``fp8_pf0`` and ``fp8_pf1`` had 1 at every row count as here);
- ``..._early`` (``fp8_early``, ``fp8_pf2_early``): the same with ``triton_pdl.EARLY_LAUNCH`` (each kernel lets
  the next one launch before it waits, so the next one's programs are resident, and prefetching, sooner).
- ``int4_noahead``: the INT4 tables with ``triton_w4a16.OPERANDS_AHEAD_MAX_ROWS`` 0 (the tensor-core path loads
  each K tile's activations, scales and zeros inside the step that uses them, as before stop 39; the committed
  ``int4`` loads them a step ahead in tiles of up to 16 rows). ``int4_ahead_ab_h100_run1/2.json`` were taken with
  the lookahead at every tile size and on the GEMV path too (``int4`` there), whence today's limit.
- ``int4_r32_w8`` / ``int4_r32_bk128``: the 32-row bucket (batch 32 decode, batch 4 verify) with 8 warps / K tiles
  of 128, loads in-step; ``int4_ahead32_w8`` / ``int4_ahead32_bn32``: the 32-row bucket with the lookahead
  (``OPERANDS_AHEAD_MAX_ROWS`` 32) and 8 warps / 32-column tiles (the committed 32-row tile lost with it at stop
  39). Prepared at stop 40 for INT4's batch-32 step, slower than bf16's (x0.93 on an H100,
  ``gpu_engine_h100_stop40.json``). Compiled for sm_90 (ptxas -v): 128 / 80 registers a thread for the stop-40 tile
  (K tiles of 64) without / with the lookahead, 64 / 62 with 8 warps, 168 / 164 with K tiles of 128, 64 / 66 with
  32 columns; no spills. Run at stop 41 on the H200 (``results/quant_rows_r32_h200.json``; batch-32 decode step /
  32-row verify forward, ms): int4 (then K tiles of 64) 7.37 / 7.24, int4_r32_bk128 7.00 / 6.71, int4_r32_w8 8.21 /
  7.86, int4_ahead32_w8 8.19 / 7.86, int4_ahead32_bn32 8.99 / 8.26 (bf16 5.20 / 5.22). K tiles of 128 are committed
  since; ``int4`` now runs them and ``int4_r32_bk128`` repeats it, the others stay relative to the stop-40 tile.

(Stop 37 also timed ``int4_nib64`` / ``int4_nib128``, a W4A16 form with one MMA per nibble position, in
``quant_rows_ab_int4_h100.json``: x0.26-0.99 of the committed INT4 step at batch 8-32, so it was removed.)

Per method and batch: the engine's median decode step and its graph replay (``gpu_engine.time_decode_steps``), and
the target forward + LM head over 8 query tokens per request at the ``--verify-batches`` (``gpu_engine.time_forwards``,
graph replay as the engine's verify steps run). ``logits_vs_fp8`` / ``logits_vs_bf16``: each method's logits of one
8-token verify forward against the committed FP8 table's / bf16's, relative L2 and argmax agreement (different MMA
sums: close, not equal; the distance to bf16 says whether a variant loses accuracy).

    python benchmarks/quant_rows_ab_gpu.py --out $OUT/quant_rows_ab_gpu.json
    python benchmarks/quant_rows_ab_gpu.py --methods bf16,int4 --batches 1,8,16,32
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from specserve.layers import quant_tiles, triton_pdl, triton_w4a16  # noqa: E402
from specserve.layers.quant_tiles import TileConfig  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402

_DOT = TileConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=0, fp8_dot=True)  # rows <= 32
_MMA_PREV = TileConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=0)  # rows 9-32 before stop 37
_DOT_K256 = TileConfig(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=0, fp8_dot=True)
_MMA_N32 = TileConfig(block_n=32, block_k=256, num_warps=4, num_stages=4, split_k=1)
_DOT_PF1 = dataclasses.replace(_DOT, prefetch=1)
_DOT_PF2 = dataclasses.replace(_DOT, prefetch=2)
_INT4_R32 = TileConfig(block_n=64, block_k=64, num_warps=4, num_stages=4, split_k=0, block_m=32)  # stop 40's
_INT4_R32_W8 = dataclasses.replace(_INT4_R32, num_warps=8)
_INT4_R32_BK128 = dataclasses.replace(_INT4_R32, block_k=128)
_INT4_R32_BN32 = dataclasses.replace(_INT4_R32, block_n=32)
# method -> (the kernel's table's by_rows entries replaced, W8A16_MAX_ROWS or None); "bf16", "fp8" and "int4" keep
# the committed tables
VARIANTS: dict[str, tuple[dict[int, TileConfig], int | None]] = {
    "fp8_prev": ({8: _DOT, 32: _MMA_PREV}, None),
    "fp8_dot64": ({64: _DOT}, 64),
    # the quant_gemm_gpu.py suggestions at 16 and 32 rows (H100, benchmarks/results/quant_gemm_rows16_64_h100.json)
    "fp8_k256": ({8: _DOT, 16: _DOT_K256, 32: _DOT_K256}, None),
    "fp8_k256_n32": ({8: _DOT, 16: _DOT_K256, 32: _MMA_N32}, None),
    "fp8_pf0": ({8: _DOT, 32: _DOT}, None),
    "fp8_pf1": ({8: _DOT_PF1, 32: _DOT_PF1}, None),
    "fp8_pf2": ({8: _DOT_PF2, 32: _DOT_PF2}, None),
    "fp8_pf2_early": ({8: _DOT_PF2, 32: _DOT_PF2}, None),
    "int4_noahead": ({}, None),
    "int4_r32_w8": ({32: _INT4_R32_W8}, None),
    "int4_r32_bk128": ({32: _INT4_R32_BK128}, None),
    "int4_ahead32_w8": ({32: _INT4_R32_W8}, None),
    "int4_ahead32_bn32": ({32: _INT4_R32_BN32}, None),
}
METHODS = ("bf16", "fp8", "int4", *VARIANTS, "fp8_early")


def quantization(method: str) -> str | None:
    return None if method == "bf16" else "int4" if method.startswith("int4") else "fp8"


def tables(method: str) -> tuple[dict, int]:
    """(by_rows of the method's kernel table, W8A16_MAX_ROWS) of ``method``."""
    table = quant_tiles.W4A16_TILES if quantization(method) == "int4" else quant_tiles.W8A16_TILES
    rows = dict(table.by_rows)
    changes, max_rows = VARIANTS.get(method, ({}, None))
    rows.update(changes)
    return rows, max_rows or quant_tiles.W8A16_MAX_ROWS


def run_method(method: str, config, args, device: torch.device, dtype: torch.dtype) -> tuple[dict, dict]:
    """(timings, {verify batch: logits [batch * 8, vocab] on the CPU}) of ``method``."""
    by_rows, max_rows = tables(method)
    saved_max, saved_ahead = quant_tiles.W8A16_MAX_ROWS, triton_w4a16.OPERANDS_AHEAD_MAX_ROWS
    quant_tiles.W8A16_MAX_ROWS = max_rows
    triton_pdl.EARLY_LAUNCH = method.endswith("_early")  # read at every launch; the graphs capture it
    ahead = 0 if method.endswith("_noahead") else 32 if method.startswith("int4_ahead32") else saved_ahead
    triton_w4a16.OPERANDS_AHEAD_MAX_ROWS = ahead
    t0 = time.perf_counter()
    try:
        # the tables hold until this method's engine is gone: its CUDA graphs capture the launches
        quant = quantization(method)
        table = quant_tiles.W4A16_TILES if quant == "int4" else quant_tiles.W8A16_TILES
        with quant_tiles.override(table, by_rows):
            model = ge.dummy_model(config, args.max_model_len, dtype, device)
            if quant is not None:
                ge.quantize_model(model, quant)
                ge.free(device)
            engine = ge.engine_for(model, config, device, max(args.batches), args.kv_gib,
                                   args.max_model_len, 8192, proposers={})
            result: dict = {"decode": {}, "verify8": {}}
            for b in args.batches:
                r = ge.time_decode_steps(engine, device, b, args.prompt_len, args.steps)
                result["decode"][str(b)] = {k: r[k] for k in ("median_step_s", "graph_replay_s")}
            del engine
            ge.free(device)
            # verify forwards as gpu_engine's verify section runs them: a runner with graphs for these batches
            runner = ge.ModelRunner(model, config, ge.CacheConfig(block_size=ge.BLOCK_SIZE,
                                                                  kv_cache_memory_gib=args.kv_gib), device)
            runner.setup_cuda_graphs(ge.CudaGraphConfig(batch_sizes=tuple(args.verify_batches),
                                                        capture_at_startup=False),
                                     args.max_model_len, max(args.verify_batches))
            logits = {}
            for b in args.verify_batches:
                got = ge.time_forwards(runner, device, b, args.prompt_len, (1, 8), args.iters, args.rounds)
                result["verify8"][str(b)] = {"forward_s": {str(q): t for q, t in got.items()},
                                             "vs_decode": got[8] / got[1]}
                torch.manual_seed(b)  # forward_inputs draws its ids from torch's default generator
                logits[b] = ge.forward_call(runner, b, args.prompt_len, 8)().float().cpu()
            del runner, model
    finally:
        quant_tiles.W8A16_MAX_ROWS = saved_max
        triton_pdl.EARLY_LAUNCH = False
        triton_w4a16.OPERANDS_AHEAD_MAX_ROWS = saved_ahead
        ge.free(device)
    result["seconds"] = time.perf_counter() - t0
    print(method, json.dumps(result), flush=True)
    return result, logits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,16,32,64")
    ap.add_argument("--verify-batches", default="2,4")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "quant_rows_ab_gpu.json"))
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.verify_batches = [int(b) for b in args.verify_batches.split(",")]
    device, dtype = torch.device("cuda"), torch.bfloat16
    config = shape_config("llama-3.1-8b")
    out: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
                 "torch": torch.__version__, "by_method": {}, "logits_vs_bf16": {}, "logits_vs_fp8": {},
                 "logits_vs_int4": {}}
    bases: dict = {}
    for method in args.methods.split(","):
        out["by_method"][method], logits = run_method(method, config, args, device, dtype)
        for name, base in bases.items():
            out[f"logits_vs_{name}"][method] = {
                str(b): {"rel_l2": ((lg - base[b]).norm() / base[b].norm()).item(),
                         "argmax_agree": (lg.argmax(-1) == base[b].argmax(-1)).float().mean().item()}
                for b, lg in logits.items()}
        if method in ("bf16", "fp8", "int4"):
            bases[method] = logits
        write(out, args.out)  # after every method: a run cut short keeps what it measured
    print(json.dumps({k: v for k, v in out.items() if k.startswith(("decode_speedup", "logits_vs")) and v}))
    return 0


def write(out: dict, path: str) -> None:
    bf16 = out["by_method"].get("bf16")
    if bf16:
        out["decode_speedup_vs_bf16"] = {
            m: {b: bf16["decode"][b]["median_step_s"] / r["decode"][b]["median_step_s"] for b in r["decode"]}
            for m, r in out["by_method"].items() if m != "bf16"}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
