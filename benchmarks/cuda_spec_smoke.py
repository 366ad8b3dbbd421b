"""CUDA smoke check for speculative decoding (GPU machine, not CI): on a CUDA device, greedy output with every
proposer (ngram, draft = the target itself, random EAGLE-3 and P-EAGLE heads; EAGLE-3 also with its draft steps
replayed from CUDA graphs, ``eagle3_graphs``) equals plain greedy output on
the same device and on CPU, token for token, for num_spec_tokens 1 and 4, batch 1 and 6, with chunked prefill;
nothing is left in the target's or the drafters' KV caches. fp32, seeded tiny model (tests/tiny.py's shape).

    python benchmarks/cuda_spec_smoke.py --out benchmarks/results/cuda_spec_smoke.json
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

from specserve.config import CacheConfig, CudaGraphConfig, EngineConfig, SchedulerConfig, SpecConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.layers.ops import select_ops  # noqa: E402
from specserve.models.loader import _init_dummy, build_model  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from tests.tiny import prompts, shape_for_tests, tiny_config  # noqa: E402

DRAFTERS = {"none": None, "ngram": None, "draft": "self", "eagle3": "dummy", "peagle": "dummy",
            "eagle3_graphs": "dummy"}


def engine(device: str, method: str, k: int, budget: int) -> LLMEngine:
    config = tiny_config()
    model = build_model(config, 512, torch.float32, torch.device("cpu"))
    _init_dummy(model, 0)
    shape_for_tests(model)
    model = model.to(device)
    model.set_ops(select_ops(torch.device(device), torch.float32))  # build_model chose the CPU kernels
    model.init_rope(torch.device(device))
    model.pack_weights()  # CPU-only packing: a no-op that drops the CPU copies on CUDA
    name = method.removesuffix("_graphs")
    spec = SpecConfig(method=name, model=DRAFTERS[method], num_spec_tokens=k) if method != "none" else SpecConfig()
    cfg = EngineConfig(model="tiny", device=device, cache=CacheConfig(block_size=4, num_blocks=256), speculative=spec,
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_model_len=512),
                       cuda_graphs=CudaGraphConfig(draft_steps=method.endswith("_graphs")))
    return LLMEngine(cfg, model, config, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/cuda_spec_smoke.json")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ps = prompts([5, 17, 3, 40, 9, 23])
    cpu_plain = [r.output_ids for r in engine("cpu", "none", 1, 512).generate(ps, params)]
    checks = {}
    ok = True
    for method in DRAFTERS:
        for k in (1, 4):
            for batch, budget in ((1, 512), (6, 512), (6, 7)):
                e = engine("cuda", method, k, budget)
                t0 = time.perf_counter()
                reqs = e.generate(ps[:batch], params)
                outs = [r.output_ids for r in reqs]
                clean = e.block_manager.num_free_blocks == e.block_manager.num_blocks and all(
                    p.kv.blocks.num_free_blocks == p.kv.blocks.num_blocks for p in e.proposers.values()
                    if hasattr(p, "kv"))
                same = outs == cpu_plain[:batch]
                if method == "eagle3_graphs" and k > 1:  # the chain must have been replayed, not skipped
                    chain = e.proposers["eagle3"].chain
                    same &= chain is not None and chain.num_replays > 0
                ok &= same and clean
                checks[f"{method}/k{k}/batch{batch}/budget{budget}"] = {
                    "equals_cpu_plain": same, "kv_clean": clean, "seconds": time.perf_counter() - t0,
                    "mean_acceptance_length": [r.spec_counters.mean_acceptance_length for r in reqs]}
                print(method, k, batch, budget, "same" if same else "DIFFERENT", "clean" if clean else "LEAK",
                      flush=True)
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "all_ok": ok,
              "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "python": platform.python_version()},
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "checks": checks}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("all ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
