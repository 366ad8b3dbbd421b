"""Where a draft-head training step spends its time, on the GPU machine (not CI): the SmolLM2-135M shape with
random weights (no GGUF needed), the real generated samples' lengths (``--data``), our trainer.

For each head variant: ms per optimiser step (after warm-up), the share spent in the target's forward
(features + distribution), and the top CUDA kernels of a few profiled steps. ``--parallel N`` also runs N
copies of the first variant as separate processes at once and reports their mean step time: whether a small
head leaves the GPU idle enough to train several heads side by side.

    python benchmarks/train_step_gpu.py --data .carry/b/gen_s11 --out $OUT/train_step_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "eagle3": dict(method="eagle3", num_layers=1),
    "eagle3_mlp4x": dict(method="eagle3", num_layers=1, head_intermediate_size=4 * 1536),
    "peagle4": dict(method="peagle", num_layers=4),
}


def build(variant: str, device: torch.device, samples, out_dir: Path, batch_tokens: int):
    from specserve.config import TrainDraftConfig
    from specserve.models.loader import load_model
    from specserve.train.trainer import Trainer
    from specserve.train.vocab import draft_vocab, token_counts

    model, config, _ = load_model("dummy:smollm2-135m", "bfloat16" if device.type == "cuda" else "float32",
                                  device, 2048)
    cfg = TrainDraftConfig(draft_vocab_size=8192, max_seq_len=1024, max_batch_tokens=batch_tokens,
                           **VARIANTS[variant])
    draft_ids = draft_vocab(token_counts(samples, config.vocab_size), 8192)
    return Trainer(model, config, cfg, draft_ids, device, out_dir, progress=False), cfg


def time_variant(variant: str, device: torch.device, samples, steps: int, profile_steps: int,
                 batch_tokens: int) -> dict:
    from specserve.train.trainer import collate, make_batches, target_outputs

    trainer, cfg = build(variant, device, samples, Path(f"/tmp/train_step_{variant}_{os.getpid()}"), batch_tokens)
    batches = make_batches(samples, cfg.max_seq_len, cfg.max_batch_tokens, 0)
    todo = [collate([samples[i] for i in b], cfg.max_seq_len, device) for b in batches[:steps + 5]]
    for batch in todo[:5]:  # warm-up: allocator, kernel selection
        trainer.train_step(batch, 1e-4)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    tokens = 0
    for batch in todo[5:]:
        trainer.train_step(batch, 1e-4)
        tokens += batch.tokens.numel()
    torch.cuda.synchronize(device)
    step_s = (time.perf_counter() - t0) / len(todo[5:])
    t0 = time.perf_counter()
    for batch in todo[5:]:
        target_outputs(trainer.target, batch.tokens, trainer.head.config.aux_layer_ids, trainer.draft_ids,
                       trainer.t2d_index)
    torch.cuda.synchronize(device)
    target_s = (time.perf_counter() - t0) / len(todo[5:])
    top = []
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for batch in todo[5:5 + profile_steps]:
                trainer.train_step(batch, 1e-4)
            torch.cuda.synchronize(device)
        events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
        total_dev = sum(e.self_device_time_total for e in events)
        top = [{"name": e.key[:90], "self_device_ms_per_step": e.self_device_time_total / 1e3 / profile_steps,
                "count_per_step": e.count / profile_steps} for e in events[:18]]
        top.insert(0, {"name": "ALL (device busy)", "self_device_ms_per_step": total_dev / 1e3 / profile_steps})
    return {"variant": variant, "config": VARIANTS[variant], "ms_per_step": step_s * 1e3,
            "tokens_per_step": tokens / len(todo[5:]), "target_forward_ms": target_s * 1e3,
            "head_params": sum(p.numel() for p in trainer.params), "top_kernels": top,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="a directory with data_train.npz (lengths of real samples)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--parallel", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    from specserve.train.generate import load_samples

    samples = load_samples(Path(args.data) / "data_train.npz")
    device = torch.device(args.device)
    if args.worker:
        r = time_variant(args.variants[0], device, samples, args.steps, 0, args.batch_tokens)
        print(json.dumps({"ms_per_step": r["ms_per_step"]}))
        return
    results = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(device),
               "num_samples": len(samples), "variants": []}
    for v in args.variants:
        r = time_variant(v, device, samples, args.steps, args.profile_steps, args.batch_tokens)
        results["variants"].append(r)
        print(f"{v}: {r['ms_per_step']:.1f} ms/step ({r['tokens_per_step']:.0f} tokens), target forward "
              f"{r['target_forward_ms']:.1f} ms, {r['head_params'] / 1e6:.1f}M params, peak {r['peak_gib']:.1f} GiB",
              flush=True)
        for k in r["top_kernels"][:12]:
            print(f"    {k['self_device_ms_per_step']:8.2f} ms  {k.get('count_per_step', 0):6.0f}x  {k['name']}")
    if args.parallel:
        cmd = [sys.executable, __file__, "--data", args.data, "--variants", args.variants[0], "--steps",
               str(args.steps), "--batch-tokens", str(args.batch_tokens), "--device", args.device, "--worker"]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(args.parallel)]
        per = [json.loads(pr.communicate()[0].strip().splitlines()[-1])["ms_per_step"] for pr in procs]
        results["parallel"] = {"processes": args.parallel, "variant": args.variants[0], "ms_per_step": per}
        print(f"{args.parallel} processes of {args.variants[0]} at once: ms/step {[round(x, 1) for x in per]}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
