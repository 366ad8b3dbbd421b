"""The FP8 decode step of the dummy Llama-3.1-8B under the W8A16 kernel's split-K choice, side by side in one run.
GPU machine, not CI.

    python benchmarks/fp8_step_knobs_gpu.py --out $OUT/fp8_step_knobs_gpu.json

At decode sizes the W8A16 kernel splits K so that its programs fill ``waves`` waves of the multiprocessors
(``triton_splitk.choose_split_k``, 2 by default; the last program of each output tile adds the partial sums). At
one row that is 3 splits for qkv, 5 for o and down, none for gate_up with the 64-wide tiles: more programs hide
the latency of their first loads, fewer pay less for the partial sums and the arrival counters. Isolated GEMM
timings did not predict the step (per-shape tiles that were 4-14% faster alone made the step slower:
results/w8a16_shapes_h100.json), so this times whole steps: ``gpu_engine.time_decode_steps`` (median engine step,
graph replay) at ``--batches`` per setting, settings alternated over ``--rounds`` rounds with graphs captured
afresh, the bf16 step at batch 1 for the issue-6 ratio, and each setting's logits (a decode row and a 2 x 8-token
verify) against the default's (other splits change the fp32 sum order only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from specserve.layers import triton_splitk  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402

WAVES = {"waves2": 2, "waves1": 1, "waves4": 4}  # the first is the default
CHOOSE_SPLIT_K = triton_splitk.choose_split_k  # the library's, whatever is patched in later


def with_waves(waves: int):
    def choose(config, k_tiles, num_tiles, device, min_tiles_per_split=2):
        return CHOOSE_SPLIT_K(config, k_tiles, num_tiles, device, waves=waves,
                              min_tiles_per_split=min_tiles_per_split)
    return choose


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "fp8_step_knobs_gpu.json"))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    device, dtype = torch.device("cuda"), torch.bfloat16
    rep: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
                 "torch": torch.__version__, "errors": {}}
    t0 = time.perf_counter()
    default = CHOOSE_SPLIT_K
    try:
        config = shape_config("llama-3.1-8b")
        model = ge.dummy_model(config, args.max_model_len, dtype, device)
        engine = ge.engine_for(model, config, device, max(batches), 4.0, args.max_model_len, 8192, proposers={})
        r = ge.time_decode_steps(engine, device, 1, args.prompt_len, args.steps)
        rep["bf16_b1"] = {k: r[k] for k in ("median_step_s", "graph_replay_s")}
        print(f"bf16 b1: step {r['median_step_s'] * 1e3:.3f} ms", flush=True)
        del engine
        ge.quantize_model(model, "fp8")
        ge.free(device)
        times = {s: {str(b): {"median_step_s": [], "graph_replay_s": []} for b in batches} for s in WAVES}
        logits, inputs = {}, None
        for _ in range(args.rounds):
            for name, waves in WAVES.items():
                triton_splitk.choose_split_k = with_waves(waves)
                engine = ge.engine_for(model, config, device, max(batches), 4.0, args.max_model_len, 8192,
                                       proposers={})
                for b in batches:
                    r = ge.time_decode_steps(engine, device, b, args.prompt_len, args.steps)
                    for key in ("median_step_s", "graph_replay_s"):
                        times[name][str(b)][key].append(r[key])
                    print(f"fp8 {name} b{b}: step {r['median_step_s'] * 1e3:.3f} ms, replay "
                          f"{r['graph_replay_s'] * 1e3:.3f} ms", flush=True)
                inputs = inputs or [ge.forward_inputs(engine.runner, 1, args.prompt_len, 1),
                                    ge.forward_inputs(engine.runner, 2, args.prompt_len, 8)]
                logits[name] = torch.cat([ge.logits_of(engine.runner, i, graphs=False).float() for i in inputs])
                del engine
                ge.free(device)
        triton_splitk.choose_split_k = default
        med = {s: {b: {k: statistics.median(v) for k, v in r.items()} for b, r in t.items()}
               for s, t in times.items()}
        base = next(iter(WAVES))
        rep["fp8"] = {"median": med, "runs": times}
        rep["speedup_vs_default"] = {s: {b: med[base][b]["median_step_s"] / med[s][b]["median_step_s"]
                                         for b in med[s]} for s in med}
        rep["fp8_speedup_b1"] = {s: rep["bf16_b1"]["median_step_s"] / med[s]["1"]["median_step_s"] for s in med}
        rep["logits_vs_default"] = {
            s: {"rel_l2": ((logits[s] - logits[base]).norm() / logits[base].norm()).item(),
                "argmax_agreement": (logits[s].argmax(-1) == logits[base].argmax(-1)).float().mean().item()}
            for s in logits}
        print(json.dumps({k: rep[k] for k in ("speedup_vs_default", "fp8_speedup_b1", "logits_vs_default")},
                         indent=1), flush=True)
    except Exception as exc:  # noqa: BLE001 - keep what was measured
        triton_splitk.choose_split_k = default
        rep["errors"]["run"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
        print(f"!!! {exc}", flush=True)
    rep["total_seconds"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
