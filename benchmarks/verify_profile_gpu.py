"""Where a verify step's extra time goes (issue 6's verify bar; GPU machine, not CI): the target forward on the
Llama-3.1-8B shape (bf16, dummy weights) at one batch, over 1 and over ``q`` query tokens per request, timed as
``gpu_engine.py`` times it (graph replay) and profiled eagerly with torch.profiler, GPU kernel time summed per
kernel name, per step. Asserts nothing; prints a table and writes JSON.

    python benchmarks/verify_profile_gpu.py --batch 32 --query-lens 1,8 --out $OUT/verify_profile.json
    python benchmarks/verify_profile_gpu.py --batch 1 --query-lens 1 --quantization fp8

``--quantization fp8|int4`` quantizes the decoder layers' projections first (``gpu_engine.quantize_model``),
``--no-fuse-act-quant`` turns off ``quant_tiles.FUSE_FP8_ACT_QUANT`` (on by default). Each row also counts
kernel launches per step (``launches``): at batch 1 a launch's ramp-up and tail cost as much as a small kernel's
work. Each mode also reports the mean duration of each kernel per role in a layer (``by_role``: the W8A16
kernel's launches as qkv, o, gate_up, down by their order; run with ``SPECSERVE_DISABLE_PDL=1`` for each
kernel's own time, since under PDL a kernel's duration includes its wait) and the GPU's idle time between
kernels (``gaps``, from the profiler's trace: a kernel's start minus the previous kernel's end on its stream,
summed per step, and per kernel name that the gap precedes):
graph replay time minus kernel time, where it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from specserve.config import CacheConfig, CudaGraphConfig  # noqa: E402
from specserve.engine.model_runner import ModelRunner  # noqa: E402
from specserve.layers import quant_tiles  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402


@torch.inference_mode()
def kernel_times(runner: ModelRunner, device: torch.device, batch: int, context: int, query_len: int,
                 steps: int, graphs: bool) -> tuple[dict[str, float], dict[str, float], dict, dict]:
    """(Seconds of GPU time per step by kernel name, launches per step by kernel name, idle gaps (``gaps``),
    mean kernel durations by role in a layer (``by_role``)):
    forward + LM head, ``steps`` steps after a warm-up; the forward replays the runner's CUDA graph when
    ``graphs``, eager otherwise."""
    ids, positions, query_lens, seq_lens, tables = ge.forward_inputs(runner, batch, context, query_len)
    forward = runner.graphs.run if graphs else runner.forward
    for _ in range(2):
        hidden, _ = forward(ids, positions, query_lens, seq_lens, tables)
        runner.model.compute_logits(hidden)
    ge.sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            hidden, _ = forward(ids, positions, query_lens, seq_lens, tables)
            runner.model.compute_logits(hidden)
        ge.sync(device)
    per_name: dict[str, float] = defaultdict(float)
    launches: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        if ev.device_time_total > 0 and ev.key and not ev.key.startswith("ProfilerStep"):
            per_name[ev.key] += ev.device_time_total * 1e-6 / steps  # device_time_total: microseconds
            launches[ev.key] += ev.count / steps
    order = sorted(per_name, key=lambda k: -per_name[k])
    events = trace_events(prof)
    return ({k: per_name[k] for k in order}, {k: launches[k] for k in order}, gaps(events, steps),
            by_role(events, steps, runner.model_config.num_hidden_layers))


def trace_events(prof: profile) -> list[dict]:
    """The profiler trace's GPU events (kernels, copies, memsets), each with ``ts`` and ``dur`` in microseconds."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
            and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def by_role(events: list[dict], steps: int, layers: int) -> dict[str, dict[str, float]]:
    """Mean duration of each kernel by its role in a layer: a kernel launched ``r * layers`` times a step (r per
    layer, in the same order in every layer) gets roles 0 .. r - 1 by its launch order, e.g. the W8A16 kernel's
    four launches of a layer are qkv, o, gate_up, down (``name#0`` .. ``name#3``). Kernels launched another
    number of times keep one role. With programmatic dependent launch a kernel's duration includes its wait for
    the one before it: profile with ``SPECSERVE_DISABLE_PDL=1`` for each kernel's own time."""
    by_name: dict[str, list[dict]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e["ts"]):
        by_name[e["name"][:60]].append(e)
    out: dict[str, dict[str, float]] = {}
    for name, evs in by_name.items():
        per_step = len(evs) // steps
        per_layer = per_step // layers if per_step % layers == 0 and per_step >= layers else 0
        roles: dict[str, list[float]] = defaultdict(list)
        for i, e in enumerate(evs):
            role = f"{name}#{i % per_layer}" if per_layer else name  # per_layer divides per_step
            roles[role].append(e["dur"])
        for role, durs in roles.items():
            out[role] = {"mean_us": sum(durs) / len(durs), "per_step": len(durs) / steps}
    return out


def gaps(events: list[dict], steps: int, big_s: float = 50e-6) -> dict:
    """Idle time of the GPU between consecutive kernels (and copies) of one stream, from the profiler's trace
    events (``trace_events``): per step in all, per name of the kernel that the gap precedes, and per (previous,
    next) pair for the largest. Gaps over ``big_s`` (the host between steps) are left out and counted apart."""
    by_stream: dict = defaultdict(list)
    for e in events:
        by_stream[(e.get("pid"), e.get("tid"))].append(e)
    total, skipped = 0.0, 0
    before: dict[str, float] = defaultdict(float)
    pairs: dict[str, float] = defaultdict(float)
    for evs in by_stream.values():
        evs.sort(key=lambda e: e["ts"])
        for prev, nxt in zip(evs, evs[1:]):
            gap = (nxt["ts"] - (prev["ts"] + prev["dur"])) * 1e-6  # trace times are microseconds
            if gap > big_s:
                skipped += 1
                continue
            gap = max(gap, 0.0)
            total += gap
            before[nxt["name"][:60]] += gap
            pairs[f"{prev['name'][:40]} -> {nxt['name'][:40]}"] += gap
    top = sorted(pairs, key=lambda k: -pairs[k])[:12]
    return {"gap_s": total / steps, "skipped_over_big": skipped, "big_s": big_s,
            "before_kernel_s": {k: v / steps for k, v in sorted(before.items(), key=lambda kv: -kv[1])},
            "top_pairs_s": {k: pairs[k] / steps for k in top}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--query-lens", default="1,8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument("--quantization", choices=["fp8", "int4"], default=None)
    ap.add_argument("--no-fuse-act-quant", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "verify_profile.json"))
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    config = shape_config(args.shape)
    if args.no_fuse_act_quant:
        quant_tiles.FUSE_FP8_ACT_QUANT = False  # read at every layer call (models/llama.py)
    model = ge.dummy_model(config, 2048, dtype, device)
    if args.quantization:
        ge.quantize_model(model, args.quantization)
        ge.free(device)
    runner = ModelRunner(model, config, CacheConfig(block_size=ge.BLOCK_SIZE, kv_cache_memory_gib=args.kv_gib),
                         device)
    runner.setup_cuda_graphs(CudaGraphConfig(batch_sizes=(args.batch,), capture_at_startup=False), 2048, args.batch)
    out = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
           "shape": args.shape, "batch": args.batch, "context": args.context, "quantization": args.quantization,
           "fuse_act_quant": quant_tiles.FUSE_FP8_ACT_QUANT, "by_query_len": {}}
    for q in map(int, args.query_lens.split(",")):
        replay = ge.time_forward(runner, device, args.batch, args.context, q, args.iters)
        row = out["by_query_len"][str(q)] = {"graph_replay_s": replay}
        print(f"q={q}: graph replay {replay * 1e3:.2f} ms")
        for mode in ("eager", "graph"):
            kernels, launches, idle, roles = kernel_times(runner, device, args.batch, args.context, q, args.steps,
                                                          mode == "graph")
            row[mode] = {"kernel_s_total": sum(kernels.values()), "launches": sum(launches.values()),
                         "kernels_s": kernels, "launches_by_kernel": launches, "gaps": idle, "by_role": roles}
            print(f"  {mode} kernels {sum(kernels.values()) * 1e3:.2f} ms, {sum(launches.values()):.0f} launches,"
                  f" gaps {idle['gap_s'] * 1e3:.3f} ms")
            for name, t in list(idle["before_kernel_s"].items())[:6]:
                print(f"    gap {t * 1e6:8.1f} us before {name}")
            for name, t in list(kernels.items())[:16]:
                print(f"    {t * 1e6:9.1f} us {launches[name]:6.0f}x  {name[:100]}")
            for role, r in sorted(roles.items(), key=lambda kv: -kv[1]["mean_us"] * kv[1]["per_step"])[:16]:
                print(f"    {r['mean_us']:8.2f} us x {r['per_step']:4.0f}  {role}")
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
