"""Does running the shipped EAGLE-3 head from Q8_0 blocks on CPU (``SpecConfig.head_cpu_quant``, the default) cost
acceptance? Mean acceptance length per MT-Bench category (first turns), greedy, with the head in Q8_0 and in
fp32, in one run on this CPU. Output is the same either way (the verifier decides); only the drafts may differ.

    .venv/bin/python benchmarks/head_quant_acceptance_cpu.py [--num-spec-tokens 3] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import torch

from specserve.bench.machine import machine_info
from specserve.config import HEAD_CPU_QUANTS, CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specserve.engine.engine import LLMEngine
from specserve.models.fetch import DEFAULT_EAGLE3_HEAD
from specserve.models.loader import load_model
from specserve.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-spec-tokens", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--data-dir", default=os.environ.get("SPECSERVE_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "head_quant_acceptance_cpu.json"))
    args = ap.parse_args()
    parts = load_model("default", "float32", torch.device("cpu"), 2048)
    tokenizer = parts[2]
    rows = [json.loads(line) for line in (Path(args.data_dir) / "mt_bench" / "question.jsonl").open() if line.strip()]
    prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}]))
                  for r in rows]
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine_info(),
              "head": str(DEFAULT_EAGLE3_HEAD.relative_to(ROOT)), "num_spec_tokens": args.num_spec_tokens,
              "max_tokens": args.max_tokens, "num_prompts": len(rows), "greedy": True,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": {}}
    outputs = {}
    for quant in HEAD_CPU_QUANTS[::-1]:  # q8_0, then none
        spec = SpecConfig(method="eagle3", model=str(DEFAULT_EAGLE3_HEAD), num_spec_tokens=args.num_spec_tokens,
                          head_cpu_quant=quant)
        cfg = EngineConfig(cache=CacheConfig(kv_cache_memory_gib=1.0), speculative=spec,
                           scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
                                                     max_model_len=2048))
        start = time.perf_counter()
        reqs = LLMEngine(cfg, *parts).generate(prompt_ids, SamplingParams(max_tokens=args.max_tokens,
                                                                          temperature=0.0))
        seconds = time.perf_counter() - start
        counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])  # category -> [drafts, accepted]
        for r, row in zip(reqs, rows):
            counts[row["category"]][0] += r.spec_counters.num_drafts
            counts[row["category"]][1] += r.spec_counters.num_accepted_tokens
        drafts, accepted = (sum(c[i] for c in counts.values()) for i in (0, 1))
        report["results"][quant] = {"mean_acceptance_length": 1 + accepted / drafts, "seconds": seconds,
                                    "per_category": {k: 1 + a / d for k, (d, a) in counts.items()}}
        outputs[quant] = [r.output_ids for r in reqs]
        print(f"{quant:5s} AL {1 + accepted / drafts:.3f} ({seconds:.0f} s): "
              + ", ".join(f"{k} {1 + a / d:.2f}" for k, (d, a) in counts.items()), flush=True)
    report["outputs_equal"] = outputs["q8_0"] == outputs["none"]
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"outputs equal: {report['outputs_equal']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
