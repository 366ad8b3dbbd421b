"""Programmatic dependent launch (``layers/triton_pdl.py``) off, on, and on with each kernel launching the next
before it waits (``EARLY_LAUNCH``), side by side in one run (GPU machine, not CI): the target forward + LM head of a
step, replayed from the runner's CUDA graph as ``gpu_engine.py`` times it, on dummy weights at real shapes. Per
case: the median step of each setting (graphs captured afresh for each, the settings timed in turn, ``--rounds``
times each), and whether the logits are bit for bit the same every way (eagerly and from the graphs). Asserts
nothing; prints a table and writes JSON. ``benchmarks/results/pdl_gpu.json`` is the two-setting run (off / on).

``--ab silu_fp8_split`` compares, the same way, the fused ``silu_and_mul_fp8`` as one program per row against its
two launches over column blocks (``triton_ops.SILU_FP8_SPLIT_MAX_ROWS``) on FP8 decode and verify steps.

    python benchmarks/pdl_gpu.py --out $OUT/pdl_gpu.json
    python benchmarks/pdl_gpu.py --ab silu_fp8_split --out $OUT/silu_fp8_split_gpu.json
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
from specserve.config import CacheConfig  # noqa: E402
from specserve.engine.model_runner import ModelRunner  # noqa: E402
from specserve.layers import triton_ops, triton_pdl  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402

# (shape, quantization, batch, query_len): decode steps at batch 1 (bf16, fp8), issue 6's batch-32 decode and
# verify (8 query tokens), and the default model's shape at batch 1 (decode, and verify of k = 4 drafts)
CASES = (("llama-3.1-8b", None, 1, 1), ("llama-3.1-8b", "fp8", 1, 1), ("llama-3.1-8b", None, 32, 1),
         ("llama-3.1-8b", None, 32, 8), ("smollm2-135m", None, 1, 1), ("smollm2-135m", None, 1, 5),
         ("smollm2-135m", None, 32, 1))




# FP8 decode at batch 1 and 8, a batch-1 verify of k = 5 drafts, and the default model's shape
FP8_CASES = (("llama-3.1-8b", "fp8", 1, 1), ("llama-3.1-8b", "fp8", 1, 6), ("llama-3.1-8b", "fp8", 8, 1),
             ("smollm2-135m", "fp8", 1, 1))
# --ab name -> (setting -> {(module, attribute): value}, cases); the first setting is the baseline
AB = {
    "pdl": ({"off": {(triton_pdl, "ENABLED"): False, (triton_pdl, "EARLY_LAUNCH"): False},
             "pdl": {(triton_pdl, "ENABLED"): True, (triton_pdl, "EARLY_LAUNCH"): False},
             "pdl_early": {(triton_pdl, "ENABLED"): True, (triton_pdl, "EARLY_LAUNCH"): True}}, CASES),
    "silu_fp8_split": ({"one_program": {(triton_ops, "SILU_FP8_SPLIT_MAX_ROWS"): 0},
                        "split": {(triton_ops, "SILU_FP8_SPLIT_MAX_ROWS"): 16}}, FP8_CASES),
}
SETTINGS = AB["pdl"][0]


def apply(setting: str) -> None:
    for (module, name), value in SETTINGS[setting].items():
        setattr(module, name, value)


def run_case(runner: ModelRunner, device: torch.device, batch: int, query_len: int, context: int, iters: int,
             rounds: int) -> dict:
    torch.manual_seed(0)
    inputs = ge.forward_inputs(runner, batch, context, query_len)
    eager = {}
    for setting in SETTINGS:
        apply(setting)
        eager[setting] = ge.logits_of(runner, inputs, graphs=False)
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    graph_logits = {}
    for _ in range(rounds):
        for setting in SETTINGS:
            apply(setting)
            ge.recapture(runner, batch)
            torch.manual_seed(0)
            times[setting].append(ge.time_forward(runner, device, batch, context, query_len, iters))
            graph_logits[setting] = ge.logits_of(runner, inputs, graphs=True)
    step = {s: statistics.median(t) for s, t in times.items()}
    base = next(iter(SETTINGS))
    return {"batch": batch, "query_len": query_len, "context": context, "step_s": step,
            "speedup_vs_base": {s: step[base] / step[s] for s in SETTINGS if s != base},
            "rounds_s": times,
            "logits_equal_eager": all(torch.equal(eager[base], v) for v in eager.values()),
            "logits_equal_graph": all(torch.equal(graph_logits[base], v) for v in graph_logits.values()),
            "graph_equals_eager": bool(torch.equal(graph_logits[base], eager[base]))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument("--ab", choices=sorted(AB), default="pdl", help="what to compare (see the module docstring)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "pdl_gpu.json"))
    args = ap.parse_args()
    global SETTINGS
    SETTINGS, cases = AB[args.ab]
    defaults = {key: getattr(*key) for values in SETTINGS.values() for key in values}
    device, dtype = torch.device("cuda"), torch.bfloat16
    out = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
           "torch": torch.__version__, "definitions": {
        "step_s": "median over rounds of the median synced time of one graph replay of the target forward plus the "
                  "eager LM head (gpu_engine.time_forward)",
        "settings": "off: no PDL; pdl: each kernel waits, then lets the next launch; pdl_early: each lets the "
                    "next launch, then waits (triton_pdl.EARLY_LAUNCH); one_program / split: silu_and_mul_fp8 as one "
                    "program per row / two launches over column blocks (triton_ops.SILU_FP8_SPLIT_MAX_ROWS)",
        "speedup_vs_base": "step_s[first setting] / step_s[setting] (pdl_gpu.json of stop 19 calls it speedup_vs_off)"},
        "ab": args.ab, "cases": []}
    start = time.perf_counter()
    built = None
    for shape, quant, batch, query_len in cases:
        if built is None or built[0] != (shape, quant):
            built = None
            ge.free(device)
            config = shape_config(shape)
            model = ge.dummy_model(config, 2048, dtype, device)
            if quant:
                ge.quantize_model(model, quant)
                ge.free(device)
            runner = ModelRunner(model, config, CacheConfig(block_size=ge.BLOCK_SIZE, kv_cache_memory_gib=args.kv_gib),
                                 device)
            built = ((shape, quant), runner)
        row = {"shape": shape, "quantization": quant or "bf16", "batch": batch, "query_len": query_len}
        try:
            row |= run_case(built[1], device, batch, query_len, args.context, args.iters, args.rounds)
        except Exception as exc:  # noqa: BLE001 - record it and go on with the other cases
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            print(row, flush=True)
            out["cases"].append(row)
            continue
        out["cases"].append(row)
        print(f"{shape:14s} {row['quantization']:5s} b={batch:<3d} q={query_len}: "
              + "  ".join(f"{s} {t * 1e3:.3f} ms" for s, t in row["step_s"].items())
              + "  x" + " x".join(f"{v:.3f}" for v in row["speedup_vs_base"].values())
              + f"  equal eager/graph {row['logits_equal_eager']}/{row['logits_equal_graph']}", flush=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    for (module, name), value in defaults.items():  # as the modules had them
        setattr(module, name, value)
    out["total_seconds"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
