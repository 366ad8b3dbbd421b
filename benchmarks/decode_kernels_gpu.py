"""Where a decode / verify step's GPU time goes, kernel by kernel (GPU machine, not CI; a diagnostic for issue 6).

For the Llama-3.1-8B shape (dummy weights) it replays the runner's CUDA graph of a (batch, query length) step,
then the LM head and the argmax as the engine runs them, under torch.profiler, and reports per step:

- ``wall_us``: host wall time of replay + logits + argmax + the host read of the tokens (what an engine step adds
  to its own host work), and ``replay_us``: the graph alone (CUDA events);
- ``kernel_us``: the summed duration of every kernel, and ``gap_us``: the span from the first kernel's start to
  the last one's end minus ``kernel_us`` (the GPU idle between kernels: launch gaps, tails);
- per kernel name: launches and microseconds per step, and the same summed by category (gemv / gemm / attention
  / norm / rope / act / quant / other);
- with ``--engine-host``: the host phases of an engine decode step at batch 1 and 32 (schedule, prepare,
  graph_run, logits, verify (which waits for the GPU), commit).

    python benchmarks/decode_kernels_gpu.py --out $OUT/decode_kernels.json
    python benchmarks/decode_kernels_gpu.py --cases bf16:1:1,fp8:1:1 --out $OUT/decode_kernels.json

A case is ``method:batch:query_len`` (method bf16 | fp8 | int4; query_len 1 is decode, 1 + k a verify step).
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
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from specserve.config import CacheConfig, CudaGraphConfig  # noqa: E402
from specserve.engine.model_runner import ModelRunner  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402

CATEGORIES = (  # first match wins, on the lower-cased kernel name
    ("attention", ("_decode_kernel", "_prefill_kernel", "_combine_splits", "_write_kv")),
    ("norm", ("rms_norm", "norm_kernel")),
    ("rope", ("rope",)),
    ("act", ("silu",)),
    ("quant", ("quant",)),
    ("gemv", ("_gemv", "w8a16", "w4a16", "gemv")),
    ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "xmma", "scaled_mm", "matmul")),
    ("argmax", ("argmax", "reduce")),
    ("copy", ("copy", "memcpy", "elementwise", "index")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, duration_us) of every GPU kernel the profiler saw, in start order."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            out.append((e.name, float(e.time_range.start), float(e.time_range.elapsed_us())))
    return sorted(out, key=lambda t: t[1])


@torch.inference_mode()
def profile_case(runner: ModelRunner, device: torch.device, batch: int, query_len: int, context: int,
                 iters: int) -> dict:
    ids, positions, qlens, slens, tables = ge.forward_inputs(runner, batch, context, query_len)
    graphs = runner.graphs
    step = graphs.step_for(graphs.bucket_for(batch), query_len)

    def one() -> list[int]:
        hidden, _ = graphs.run(ids, positions, qlens, slens, tables)
        return runner.model.compute_logits(hidden).argmax(dim=-1).tolist()

    for _ in range(3):
        one()
    torch.cuda.synchronize(device)
    walls = []
    for _ in range(iters):
        t0 = time.perf_counter()
        one()
        walls.append(time.perf_counter() - t0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = []
    for _ in range(iters):
        start.record()
        step.graph.replay()
        end.record()
        end.synchronize()
        replays.append(start.elapsed_time(end) * 1e3)
    n_prof = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n_prof):
            one()
        torch.cuda.synchronize(device)
    events = kernel_events(prof)
    by_name: dict[str, list[float]] = {}
    for name, _, dur in events:
        by_name.setdefault(name, []).append(dur)
    kernel_us = sum(d for _, _, d in events) / n_prof
    span_us = (events[-1][1] + events[-1][2] - events[0][1]) / n_prof if events else 0.0
    names = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    cats: dict[str, float] = {}
    for name, durs in by_name.items():
        cats[category(name)] = cats.get(category(name), 0.0) + sum(durs) / n_prof
    return {
        "batch": batch, "query_len": query_len, "context": context,
        "wall_us": statistics.median(walls) * 1e6, "replay_us": statistics.median(replays),
        "kernels_per_step": len(events) / n_prof, "kernel_us": kernel_us,
        "span_us_incl_host_between_steps": span_us,
        "by_category_us": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        "by_kernel": [{"name": n[:120], "category": category(n), "per_step": len(d) / n_prof,
                       "us_per_step": sum(d) / n_prof, "mean_us": sum(d) / len(d)} for n, d in names[:40]],
        "gaps": gap_summary(events, n_prof),
    }


@torch.inference_mode()
def engine_host_phases(model, config, device: torch.device, batch: int, prompt_len: int, steps: int) -> dict:
    """Median microseconds of each phase of ``engine.step()`` once ``batch`` requests decode: ``schedule``,
    ``prepare`` (block tables, until the runner starts), ``graph_run`` (static values built, copied, replay
    launched), ``logits`` (LM head launched), ``verify`` (argmax, and the wait for the GPU in ``tolist``),
    ``commit`` (everything after). The GPU idles during schedule + prepare + the host part of graph_run + commit."""
    import specserve.engine.engine as engine_mod
    engine = ge.engine_for(model, config, device, batch, 4.0, 1024, 8192, proposers={})
    marks: dict[str, float] = {}

    def wrap(obj, name: str, before: str | None, after: str | None):
        real = getattr(obj, name)

        def timed(*a, **k):
            if before:
                marks[before] = time.perf_counter()
            r = real(*a, **k)
            if after:
                marks[after] = time.perf_counter()
            return r
        setattr(obj, name, timed)

    ge.start_decoding(engine, batch, prompt_len, steps + 16, seed=5)
    for _ in range(3):
        engine.step()
    import specserve.engine.cuda_graphs as graphs_mod
    real_replay = torch.cuda.CUDAGraph.replay
    wrap(engine.scheduler, "schedule", None, "scheduled")
    wrap(engine.runner.graphs, "run", "run_start", "run_end")
    wrap(engine_mod, "verify", "verify_start", "verify_end")
    wrap(graphs_mod, "padded_step_values", "values_start", "values_end")
    wrap(engine.runner.graphs, "_load", "load_start", "load_end")
    wrap(torch.cuda.CUDAGraph, "replay", "replay_start", "replay_end")
    phases: dict[str, list[float]] = {k: [] for k in ("schedule", "prepare", "graph_run", "logits", "verify",
                                                         "commit", "step", "run.values", "run.load", "run.replay")}
    for _ in range(steps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        m = marks
        for name, a, b in (("schedule", t0, m["scheduled"]), ("prepare", m["scheduled"], m["run_start"]),
                           ("graph_run", m["run_start"], m["run_end"]), ("logits", m["run_end"], m["verify_start"]),
                           ("verify", m["verify_start"], m["verify_end"]), ("commit", m["verify_end"], t1),
                           ("step", t0, t1), ("run.values", m["values_start"], m["values_end"]),
                           ("run.load", m["load_start"], m["load_end"]),
                           ("run.replay", m["replay_start"], m["replay_end"])):
            phases[name].append((b - a) * 1e6)
    while engine.has_unfinished():
        engine.step()
    torch.cuda.CUDAGraph.replay = real_replay
    return {k: statistics.median(v) for k, v in phases.items()}


def gap_summary(events: list[tuple[str, float, float]], n_prof: int) -> dict:
    """Idle time between consecutive kernels, split into small gaps (< 20 us: inside a graph or between
    back-to-back launches) and large ones (host work between steps), per step."""
    small, large = 0.0, 0.0
    after: dict[str, float] = {}
    for (n0, s0, d0), (_, s1, _) in zip(events, events[1:]):
        gap = s1 - (s0 + d0)
        if gap < 0:
            continue
        if gap < 20:
            small += gap
            c = category(n0)
            after[c] = after.get(c, 0.0) + gap / n_prof
        else:
            large += gap
    return {"small_gap_us_per_step": small / n_prof, "large_gap_us_per_step": large / n_prof,
            "small_gap_after_category_us": dict(sorted(after.items(), key=lambda kv: -kv[1]))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", "/tmp")) / "decode_kernels.json"))
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--cases", default="bf16:1:1,bf16:32:1,bf16:32:8,fp8:1:1")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--engine-host", action="store_true", help="also time the host phases of engine.step() (bf16)")
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    config = shape_config(args.shape)
    cases = [(m, int(b), int(q)) for m, b, q in (c.split(":") for c in args.cases.split(","))]
    out: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
                 "torch": torch.__version__, "shape": args.shape, "cases": {}, "errors": {}}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for method in dict.fromkeys(m for m, _, _ in cases):
        model = ge.dummy_model(config, 1024, dtype, device)
        if method != "bf16":
            ge.quantize_model(model, method)
            ge.free(device)
        batches = sorted({b for m, b, _ in cases if m == method})
        runner = ModelRunner(model, config, CacheConfig(block_size=ge.BLOCK_SIZE, kv_cache_memory_gib=8.0), device)
        runner.setup_cuda_graphs(CudaGraphConfig(batch_sizes=tuple(batches), capture_at_startup=False), 1024,
                                 max(batches))
        for m, b, q in cases:
            if m != method:
                continue
            key = f"{m}:b{b}:q{q}"
            try:
                r = profile_case(runner, device, b, q, args.context, args.iters)
            except Exception as exc:  # noqa: BLE001 - record and go on
                out["errors"][key] = f"{type(exc).__name__}: {exc}"
                print(key, "failed:", exc, flush=True)
                continue
            out["cases"][key] = r
            print(f"{key}: wall {r['wall_us']:.0f} us, replay {r['replay_us']:.0f} us, kernels "
                  f"{r['kernels_per_step']:.0f} = {r['kernel_us']:.0f} us, gaps {r['gaps']}", flush=True)
            print("   by category:", {k: round(v) for k, v in r["by_category_us"].items()}, flush=True)
            for row in r["by_kernel"][:14]:
                print(f"   {row['us_per_step']:8.1f} us  x{row['per_step']:5.1f}  {row['name'][:90]}", flush=True)
            out_path.write_text(json.dumps(out, indent=1))
        del runner, model
        ge.free(device)
    if args.engine_host:
        model = ge.dummy_model(config, 1024, dtype, device)
        for b in (1, 32):
            try:
                out["engine_host_us"] = out.get("engine_host_us", {}) | {
                    str(b): engine_host_phases(model, config, device, b, args.context, 30)}
                phases = out["engine_host_us"][str(b)]
                print(f"engine host phases b={b} (us):", {k: round(v) for k, v in phases.items()}, flush=True)
            except Exception as exc:  # noqa: BLE001 - record and go on
                out["errors"][f"engine_host_b{b}"] = f"{type(exc).__name__}: {exc}"
                print("engine host phases failed:", exc, flush=True)
        del model
        ge.free(device)
    out_path.write_text(json.dumps(out, indent=1))
    print("wrote", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
