"""Whole FP8 decode steps of the dummy Llama-3.1-8B under several settings, side by side in one run (GPU machine):
the shared body of ``w8a16_shapes_gpu.py`` and ``fp8_step_knobs_gpu.py``.

Isolated kernel timings do not predict the step (a GEMM overlaps its neighbours under programmatic dependent
launch), so a kernel setting is judged here: ``gpu_engine.time_decode_steps`` (median engine step and graph
replay) at each batch, the settings alternated over ``rounds`` rounds with the engine (and its CUDA graphs) built
afresh inside each setting, the bf16 step at batch 1 for issue 6's ratio, and each setting's logits (a decode row
and a 2 x 8-token verify, eager) against the first setting's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

import benchmarks.gpu_engine as ge
from specserve.models.shapes import shape_config


def fp8_step_ab(out: dict, settings: dict[str, Callable[[torch.nn.Module], AbstractContextManager]],
                device: torch.device,
                batches: list[int], rounds: int = 2, steps: int = 20, prompt_len: int = 512,
                max_model_len: int = 1024, shape: str = "llama-3.1-8b") -> None:
    """Fill ``out`` with ``bf16_b1``, ``fp8`` (per setting and batch: medians and every run),
    ``speedup_vs_first``, ``fp8_speedup_b1`` and ``logits_vs_first`` (equal, largest difference, relative L2,
    argmax agreement). ``settings``: name -> a factory that takes the (FP8-quantized) model and returns the
    context in force while that setting's engine is built and timed."""
    config = shape_config(shape)
    model = ge.dummy_model(config, max_model_len, torch.bfloat16, device)
    engine = ge.engine_for(model, config, device, max(batches), 4.0, max_model_len, 8192, proposers={})
    r = ge.time_decode_steps(engine, device, 1, prompt_len, steps)
    out["bf16_b1"] = {k: r[k] for k in ("median_step_s", "graph_replay_s")}
    print(f"bf16 b1: step {r['median_step_s'] * 1e3:.3f} ms, replay {r['graph_replay_s']}", flush=True)
    del engine
    ge.quantize_model(model, "fp8")
    ge.free(device)
    times = {s: {str(b): {"median_step_s": [], "graph_replay_s": []} for b in batches} for s in settings}
    logits, inputs = {}, None
    for _ in range(rounds):
        for name, context in settings.items():
            with context(model):
                engine = ge.engine_for(model, config, device, max(batches), 4.0, max_model_len, 8192, proposers={})
                for b in batches:
                    r = ge.time_decode_steps(engine, device, b, prompt_len, steps)
                    for key in ("median_step_s", "graph_replay_s"):
                        times[name][str(b)][key].append(r[key])
                    print(f"fp8 {name} b{b}: step {r['median_step_s'] * 1e3:.3f} ms, replay {r['graph_replay_s']}",
                          flush=True)
                # a decode row and a 2 x 8-token verify (16 rows)
                inputs = inputs or [ge.forward_inputs(engine.runner, 1, prompt_len, 1),
                                    ge.forward_inputs(engine.runner, 2, prompt_len, 8)]
                logits[name] = torch.cat([ge.logits_of(engine.runner, i, graphs=False).float() for i in inputs])
                del engine
                ge.free(device)
    med = {s: {b: {k: statistics.median(v) for k, v in r.items() if None not in v} for b, r in t.items()}
           for s, t in times.items()}  # graph_replay_s is None without graphs (CPU)
    first = next(iter(settings))
    out["fp8"] = {"median": med, "runs": times, "first": first}
    out["speedup_vs_first"] = {s: {b: {k: med[first][b][k] / med[s][b][k] for k in med[first][b]}
                                   for b in med[first]} for s in settings}
    out["fp8_speedup_b1"] = {s: out["bf16_b1"]["median_step_s"] / med[s]["1"]["median_step_s"] for s in med
                             if "1" in med[s]}
    out["logits_vs_first"] = {}
    for name in settings:
        diff = (logits[first] - logits[name]).abs()
        out["logits_vs_first"][name] = {
            "equal": bool(torch.equal(logits[first], logits[name])), "max_abs_diff": diff.max().item(),
            "rel_l2": (diff.norm() / logits[first].norm()).item(),
            "argmax_agreement": (logits[first].argmax(-1) == logits[name].argmax(-1)).float().mean().item()}
    print(json.dumps({k: out[k] for k in ("speedup_vs_first", "fp8_speedup_b1", "logits_vs_first")}, indent=1),
          flush=True)


def add_step_args(ap: argparse.ArgumentParser, batches: str = "1,8") -> None:
    """The step comparison's options (``fp8_step_ab_args`` reads them)."""
    ap.add_argument("--batches", default=batches, help="decode batch sizes timed, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the alternated settings")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per batch and round")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--shape", default="llama-3.1-8b", help="model shape of the steps")


def fp8_step_ab_args(out: dict, settings: dict[str, Callable[[torch.nn.Module], AbstractContextManager]],
                     device: torch.device, args: argparse.Namespace) -> None:
    """``fp8_step_ab`` with ``add_step_args``' options."""
    fp8_step_ab(out, settings, device, [int(b) for b in args.batches.split(",")], args.rounds, args.steps,
                args.prompt_len, args.max_model_len, args.shape)
