"""Small-batch decode steps of the Llama-3.1-8B shape (dummy weights) with and without the L2 warm-up of each
projection's first weight bytes during the short kernels before it (``quant_tiles.WEIGHT_PREFETCH``,
``layers/triton_prefetch.py``), side by side in one run (GPU machine, not CI).

Per dtype (bf16, and the FP8 / INT4 quantization of the same weights) and per variant (``VARIANTS``: budgets per
window, bulk or per-line prefetches), one ``ModelRunner`` with CUDA graphs captured under that variant; then every
(variant, batch, query length) step is timed interleaved with the others (``gpu_engine.interleaved_medians``: the
target forward + LM head as the engine runs it, host-synchronised), and each captured graph's replay alone
(device time). The logits of every variant are compared with the variant ``off``'s on the same inputs (a warm-up
only hints the cache: they must be equal bit for bit).

    python benchmarks/weight_prefetch_ab_gpu.py --out $OUT/weight_prefetch_ab_gpu.json
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
from specserve.layers import quant_tiles  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402

MIB = 1 << 20
ALL = 1 << 30  # more than any projection: the whole weight
# variant -> (WEIGHT_PREFETCH, WEIGHT_PREFETCH_BULK)
VARIANTS: dict[str, tuple[dict[str, int] | None, bool]] = {
    "off": (None, True),
    "o_all": ({"o": ALL}, True),
    "all_8m": ({"o": ALL, "gate_up": 8 * MIB, "down": 8 * MIB, "qkv": 8 * MIB}, True),
    "all_4m": ({"o": ALL, "gate_up": 4 * MIB, "down": 4 * MIB, "qkv": 4 * MIB}, True),
    "all_16m": ({"o": ALL, "gate_up": 16 * MIB, "down": 16 * MIB, "qkv": 16 * MIB}, True),
    "o_16m_8m": ({"o": 16 * MIB, "gate_up": 8 * MIB, "down": 8 * MIB, "qkv": 8 * MIB}, True),
    "all_8m_line": ({"o": ALL, "gate_up": 8 * MIB, "down": 8 * MIB, "qkv": 8 * MIB}, False),
}


def step_graph(runner, batch: int, query_len: int):
    graphs = runner.graphs
    bucket = graphs.bucket_for(batch) if graphs is not None else None
    step = graphs.steps.get((bucket, query_len, ())) if bucket is not None else None
    return None if step is None else step.graph


def run_dtype(method: str, config, args, device: torch.device) -> dict:
    t0 = time.perf_counter()
    model = ge.dummy_model(config, args.max_model_len, torch.bfloat16, device)
    if method != "bf16":
        ge.quantize_model(model, method)
        ge.free(device)
    steps = [(b, 1) for b in args.batches] + [(b, 8) for b in args.verify_batches]
    runners, calls, logits = {}, {}, {}
    saved = (quant_tiles.WEIGHT_PREFETCH, quant_tiles.WEIGHT_PREFETCH_BULK)
    try:
        for name in args.variants:
            quant_tiles.WEIGHT_PREFETCH, quant_tiles.WEIGHT_PREFETCH_BULK = VARIANTS[name]
            runner = ge.ModelRunner(model, config, ge.CacheConfig(block_size=ge.BLOCK_SIZE,
                                                                  kv_cache_memory_gib=args.kv_gib), device)
            runner.setup_cuda_graphs(ge.CudaGraphConfig(batch_sizes=tuple(sorted({b for b, _ in steps})),
                                                        capture_at_startup=False),
                                     args.max_model_len, max(b for b, _ in steps))
            runners[name] = runner
            for b, q in steps:
                torch.manual_seed(1000 * b + q)  # forward_inputs draws its ids from torch's default generator
                call = ge.forward_call(runner, b, args.prompt_len, q)
                with torch.inference_mode():
                    logits[(name, b, q)] = call().float().cpu()  # captures the graph under this variant
                calls[(name, b, q)] = call
    finally:
        quant_tiles.WEIGHT_PREFETCH, quant_tiles.WEIGHT_PREFETCH_BULK = saved
    medians = ge.interleaved_medians(calls, device, args.iters, args.rounds)
    replay = {}
    for _ in range(args.rounds):  # graph replays alone, interleaved across variants too
        for key in calls:
            graph = step_graph(runners[key[0]], key[1], key[2])
            if graph is not None:
                with torch.inference_mode():
                    calls[key]()  # the graph re-reads the static inputs: this step's, not another shape's
                replay.setdefault(key, []).append(ge.median_replay_s(graph, args.iters))
    out: dict = {"by_variant": {}}
    for name in args.variants:
        rows = {}
        for b, q in steps:
            key = (name, b, q)
            base = logits[("off", b, q)] if "off" in args.variants else None
            rows[f"b{b}_q{q}"] = {
                "step_s": medians[key],
                "graph_replay_s": statistics.median(replay[key]) if key in replay else None,
                "logits_equal_off": None if base is None else bool(torch.equal(logits[key], base)),
            }
        out["by_variant"][name] = rows
    if "off" in args.variants:
        out["speedup_vs_off"] = {
            name: {step: {"step": out["by_variant"]["off"][step]["step_s"] / r["step_s"],
                          "graph_replay": (out["by_variant"]["off"][step]["graph_replay_s"] / r["graph_replay_s"]
                                           if r["graph_replay_s"] else None)}
                   for step, r in rows.items()}
            for name, rows in out["by_variant"].items() if name != "off"}
    del runners, calls, model
    ge.free(device)
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="bf16,fp8")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--verify-batches", default="1")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "weight_prefetch_ab_gpu.json"))
    args = ap.parse_args()
    args.variants = args.variants.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.verify_batches = [int(b) for b in args.verify_batches.split(",") if b]
    device = torch.device("cuda")
    config = shape_config("llama-3.1-8b")
    out: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
                 "torch": torch.__version__, "variants": {k: {"budgets": v[0], "bulk": v[1]}
                                                          for k, v in VARIANTS.items() if k in args.variants},
                 "by_method": {}}
    for method in args.methods.split(","):
        out["by_method"][method] = run_dtype(method, config, args, device)
        print(method, json.dumps(out["by_method"][method].get("speedup_vs_off"), indent=None), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))  # after every method: a cut-short run keeps its part
    return 0


if __name__ == "__main__":
    sys.exit(main())
