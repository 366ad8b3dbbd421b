"""Where a speculative decode step's time goes on the GPU (GPU machine, not CI): the SmolLM2-135M shape (random
weights, as gpu_engine.py's end-to-end section), ``--concurrency`` requests at once (default 1), greedy or sampled
(``--temperature``), for plain decoding
and for EAGLE-3 (a random head: every step drafts k and verifies k + 1 tokens; what a trained head accepts
changes how many tokens a step yields, not what a step costs), with drafting eager and with its CUDA graphs
(``CudaGraphConfig.draft_steps``).

Per method:
- ``step_ms``: wall time per ``engine.step()`` over a 128-token generation (median of 3 runs);
- ``gpu_busy_ms``: CUDA kernel + memcpy time per step from ``torch.profiler`` (the device's work; the rest of a
  step is the device waiting for the host), and kernels launched per step;
- ``phases_ms``: host wall time per step inside each phase of the step (``execute`` = the target forward
  launch, ``verify``, ``commit``, ``draft`` = ``observe`` + ``propose``, the head's forward and its token
  readback inside it, ...), from timers wrapped around them (a separate run, ``step_ms_with_phase_timers``); a
  phase that reads results back to the host includes the wait for the device;
- ``host_top``: cProfile's functions by own time (the host's Python and torch-dispatch cost).

Asserts nothing; prints a table and writes JSON.

    python benchmarks/spec_step_profile_gpu.py --out $OUT/spec_step_profile_gpu.json
    python benchmarks/spec_step_profile_gpu.py --concurrency 64 --methods none,eagle3_graphs --out ...
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
import specserve.engine.engine as engine_mod  # noqa: E402
from specserve.config import SpecConfig  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.spec.params import SPEC_OFF, SpecParams  # noqa: E402


@contextmanager
def timed_phases(engine, totals: dict[str, float]):
    """Accumulate host wall time per phase of the step into ``totals`` (seconds) while inside; the wrappers are
    undone afterwards. Phases nest (``propose`` runs inside ``draft``)."""
    saved = []

    def wrap(obj, name: str, label: str):
        fn = getattr(obj, name)

        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - t0
        saved.append((obj, name, fn))
        setattr(obj, name, wrapped)

    wrap(engine.runner, "execute", "execute")
    wrap(engine_mod, "verify", "verify")  # engine.step calls the module's global
    wrap(engine_mod, "sample_on_device", "sample")
    wrap(engine, "_commit", "commit")
    wrap(engine, "_draft", "draft")
    wrap(engine, "_observe", "observe")
    wrap(engine.scheduler, "schedule", "schedule")
    wrap(engine, "_prepare", "prepare")
    for proposer in engine.proposers.values():
        wrap(proposer, "propose", "propose")
        if hasattr(proposer, "_chain"):
            wrap(proposer, "_chain", "propose.chain")
        if hasattr(proposer, "head"):
            wrap(proposer.head, "forward", "propose.head_forward")
            wrap(proposer.head, "draft_token_ids", "propose.draft_token_ids")
    try:
        yield
    finally:
        for obj, name, fn in reversed(saved):
            if obj is engine_mod:
                setattr(obj, name, fn)
            else:
                delattr(obj, name)  # the instance attribute set above; the class's method shows again


def steps_of(engine, prompts: list[list[int]], params: SamplingParams, spec: SpecParams) -> int:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params, spec)
    n = 0
    while engine.has_unfinished():
        engine.step()
        n += 1
    return n


def profile_method(engine, device, prompt: list[list[int]], params, spec) -> dict:
    warm = SamplingParams(max_tokens=16, temperature=params.temperature, seed=params.seed, ignore_eos=True)
    engine.generate(prompt, warm, spec)  # warm-up: kernels compiled and graphs captured at this batch
    walls = []
    for _ in range(3):
        ge.sync(device)
        t0 = time.perf_counter()
        n = steps_of(engine, prompt, params, spec)
        ge.sync(device)
        walls.append((time.perf_counter() - t0) / n)
    out = {"steps": n, "step_ms": statistics.median(walls) * 1e3}
    totals: dict[str, float] = {}
    with timed_phases(engine, totals):
        ge.sync(device)
        t0 = time.perf_counter()
        n = steps_of(engine, prompt, params, spec)
        ge.sync(device)
        out["step_ms_with_phase_timers"] = (time.perf_counter() - t0) / n * 1e3
    phases = {k: v * 1e3 / n for k, v in totals.items()}
    with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        n = steps_of(engine, prompt, params, spec)
        ge.sync(device)
    gpu_us, launches, by_kernel = 0.0, 0, {}
    for evt in prof.key_averages():
        dev_us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if dev_us and evt.device_type == torch.autograd.DeviceType.CUDA:
            gpu_us += dev_us
            launches += evt.count
            by_kernel[evt.key[:80]] = (round(dev_us / n, 2), round(evt.count / n, 2))
    out |= {"gpu_busy_ms": gpu_us / 1e3 / n, "gpu_ops_per_step": launches / n, "phases_ms": phases,
            "kernels_us_per_step": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:25])}
    pr = cProfile.Profile()
    pr.enable()
    n = steps_of(engine, prompt, params, spec)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    out["host_top"] = s.getvalue().splitlines()[-32:]
    out["host_total_ms_per_step_under_cprofile"] = pstats.Stats(pr).total_tt * 1e3 / n
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=1, help="requests decoded together")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled (seed 0), rejection sampling")
    ap.add_argument("--methods", default="none,eagle3,eagle3_graphs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a wiring check (the profile is the GPU's)")
    args = ap.parse_args()
    device = torch.device(args.device)
    config, model, prompt, max_len = ge.small_model_and_prompts(device, args.prompt_len, args.new_tokens,
                                                                args.concurrency)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=args.temperature, ignore_eos=True,
                            seed=0 if args.temperature else None)
    result = {"command": " ".join(["python", *sys.argv]),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "shape": "smollm2-135m", "k": args.k,
              "concurrency": args.concurrency, "temperature": args.temperature, "methods": {}}
    head = SpecConfig(method="eagle3", model="dummy", num_spec_tokens=args.k)
    runs = {"none": (SpecConfig(), SPEC_OFF, False), "eagle3": (head, SpecParams("eagle3", args.k), False),
            "eagle3_graphs": (head, SpecParams("eagle3", args.k), True)}
    for name in args.methods.split(","):
        spec_cfg, spec, graphs = runs[name]
        engine = ge.engine_for(model, config, device, max(4, args.concurrency), 2.0, max_len, 4096, spec=spec_cfg,
                               draft_graphs=graphs)
        row = profile_method(engine, device, prompt, params, spec)
        result["methods"][name] = row
        print(f"{name:14s} step {row['step_ms']:.3f} ms  gpu busy {row['gpu_busy_ms']:.3f} ms  "
              f"ops {row['gpu_ops_per_step']:.0f}  phases " + " ".join(
                  f"{k} {v:.3f}" for k, v in row["phases_ms"].items()), flush=True)
        del engine
        ge.free(device)
    out = Path(args.out or (Path(os.environ.get("OUT", "/tmp")) / "spec_step_profile_gpu.json"))
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
