"""Where the GPU time goes (GPU machine, not CI): the engine's decode step and the draft-head trainer's step on
the SmolLM2-135M shape (dummy weights, bf16), timed and profiled with torch.profiler. A diagnostic for issue 6
(engine speed) and issue 4 (training throughput); it asserts nothing.

    python benchmarks/profile_gpu.py --out $OUT/profile_gpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, TrainDraftConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402


def table(prof, sort: str, rows: int = 18) -> str:
    return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60)


def engine_profile(model, config, device, concurrency: int, prompt_len: int, out: dict) -> None:
    cfg = EngineConfig(device="cuda", cache=CacheConfig(kv_cache_memory_gib=20.0),
                       scheduler=SchedulerConfig(max_num_seqs=concurrency, max_num_batched_tokens=16384,
                                                 max_model_len=2048))
    engine = LLMEngine(cfg, model, config, None, proposers={})
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(concurrency)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    step_times = []
    while engine.has_unfinished():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        if len(step_times) == 30 and concurrency >= 64:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    engine.step()
                torch.cuda.synchronize()
            print(f"--- engine decode, concurrency {concurrency}: by CUDA time")
            print(table(prof, "cuda_time_total"))
            print(f"--- engine decode, concurrency {concurrency}: by CPU self time")
            print(table(prof, "self_cpu_time_total"))
    decode = sorted(step_times[5:])
    med = decode[len(decode) // 2] if decode else float("nan")
    out[f"engine_c{concurrency}"] = {"median_step_s": med, "tok_s": concurrency / med, "steps": len(step_times)}
    print(f"engine concurrency {concurrency}: median decode step {med * 1e3:.2f} ms -> {concurrency / med:.0f} tok/s",
          flush=True)


def trainer_profile(model, config, device, method: str, out: dict, batch_tokens: int = 16384) -> None:
    from specserve.train.generate import Sample
    from specserve.train.trainer import Trainer, collate, make_batches

    cfg = TrainDraftConfig(method=method, num_layers=1 if method == "eagle3" else 2, max_batch_tokens=batch_tokens,
                           max_seq_len=1024, anchors_per_seq=256, anchor_chunk=128)
    gen = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist(), int(n) // 3)
               for n in torch.randint(300, 1024, (200,), generator=gen)]
    trainer = Trainer(model, config, cfg, torch.arange(8192), device, Path("/tmp/profile_trainer"), progress=False)
    batches = make_batches(samples, cfg.max_seq_len, cfg.max_batch_tokens, 0)

    def step(i):
        batch = collate([samples[j] for j in batches[i % len(batches)]], cfg.max_seq_len, device)
        trainer.opt.zero_grad(set_to_none=True)
        trainer._loss(batch, train=True)
        trainer.opt.step()

    for i in range(3):
        step(i)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    n = 10 if device.type == "cuda" else 1
    for i in range(n):
        step(i)
    sync()
    per = (time.perf_counter() - t0) / n
    out[f"train_{method}"] = {"step_s": per, "batch_tokens": cfg.max_batch_tokens}
    print(f"train {method}: {per * 1e3:.1f} ms/step at {cfg.max_batch_tokens} batch tokens", flush=True)
    if device.type != "cuda":
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(2):
            step(i)
        sync()
    print(f"--- train {method}: by CUDA time")
    print(table(prof, "cuda_time_total"))
    print(f"--- train {method}: by CPU self time")
    print(table(prof, "self_cpu_time_total", 12))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/profile_gpu.json")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    args = ap.parse_args()
    device = torch.device(args.device)
    model, config, _ = load_model("dummy:smollm2-135m", "bfloat16" if device.type == "cuda" else "float32", device,
                                  2048)
    out: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__}
    if not args.skip_engine:
        for c in (1, 64, 256):
            engine_profile(model, config, device, c, 300, out)
    for method in ("eagle3", "peagle"):
        trainer_profile(model, config, device, method, out, args.batch_tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
