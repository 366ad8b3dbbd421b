"""CUDA smoke check (GPU machine, not CI): the engine runs on a CUDA device and its greedy output equals
the CPU engine's, token for token, on a seeded random model (fp32), alone and batched, with chunked prefill.
Also times plain decoding of the SmolLM2-135M shape (dummy weights, bf16) at batch 1 and 8: eager torch,
no CUDA graphs or Triton kernels yet, so this is a baseline, not a target.

    python benchmarks/cuda_smoke.py --out benchmarks/results/cuda_smoke.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.layers.ops import select_ops  # noqa: E402
from specserve.models.loader import _init_dummy, build_model, load_model  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402


def tiny_engine(device: str, budget: int) -> LLMEngine:
    config = ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True)
    model = build_model(config, 512, torch.float32, torch.device("cpu"))
    _init_dummy(model, 0)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(8.0)
    model = model.to(device)
    model.set_ops(select_ops(torch.device(device), torch.float32))  # build_model chose the CPU kernels
    model.init_rope(torch.device(device))
    cfg = EngineConfig(model="tiny", device=device, cache=CacheConfig(block_size=4, num_blocks=256),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_model_len=512))
    return LLMEngine(cfg, model, config, None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/cuda_smoke.json")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 17, 3, 40, 9, 23)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cpu = [r.output_ids for r in tiny_engine("cpu", 512).generate(prompts, greedy)]
    checks = {}
    for budget in (512, 7):
        gpu = [r.output_ids for r in tiny_engine("cuda", budget).generate(prompts, greedy)]
        checks[f"batched_budget_{budget}"] = gpu == cpu
    alone = [tiny_engine("cuda", 512).generate([p], greedy)[0].output_ids for p in prompts]
    checks["alone"] = alone == cpu

    timings = {}
    model, config, _ = load_model("dummy:smollm2-135m", "bfloat16", torch.device("cuda"), 2048)
    for b in (1, 8):
        cfg = EngineConfig(device="cuda", cache=CacheConfig(num_blocks=1024),
                           scheduler=SchedulerConfig(max_num_seqs=b, max_model_len=2048))
        engine = LLMEngine(cfg, model, config, None)
        ps = [[(i * 7 + j) % 49000 for j in range(64)] for i in range(b)]
        engine.generate(ps[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reqs = engine.generate(ps, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        timings[str(b)] = sum(len(r.output_ids) for r in reqs) / dt
    report = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(),
              "cuda_equals_cpu_greedy": checks, "dummy_smollm2_bf16_eager_output_tok_s": timings}
    print(json.dumps(report, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
