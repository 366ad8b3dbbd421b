"""Adaptive speculation on CPU, side by side in one run: plain decoding, a fixed k = 3 and the adaptive policy
(spec/policy.py) at several ``probe_steps`` (decisions a try or probe keeps its arm), with the EAGLE-3 head the
repository ships on SmolLM2-135M-Instruct (fp32 target, the head from its Q8_0 blocks), the first
``--num-prompts`` MT-Bench first turns at once (a batch that drains as requests end at EOS), greedy. On CPU a
draft step costs a good part of a target step and this head's MT-Bench acceptance is low, so plain decoding is
the best arm at batch 8: what the policy loses to plain is what its exploration costs. Every output equals
plain decoding's (checked). Writes JSON and prints a table.

    .venv/bin/python benchmarks/policy_cpu.py --out benchmarks/results/policy_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.models.fetch import default_model_path  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.spec.eagle3 import load_eagle_proposer  # noqa: E402
from specserve.spec.params import SPEC_OFF, SpecParams  # noqa: E402
from specserve.spec.policy import SpecPolicy  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--probe-steps", default="2,3,4")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared/data/mt_bench/question.jsonl")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/policy_cpu.json")
    args = ap.parse_args()
    device = torch.device("cpu")
    model, config, tok = load_model(str(default_model_path()), "float32", device, 1024)
    cfg = EngineConfig(device="cpu", cache=CacheConfig(kv_cache_memory_gib=0.5),
                       scheduler=SchedulerConfig(max_num_seqs=args.num_prompts, max_num_batched_tokens=2048,
                                                 max_model_len=1024))
    probe = LLMEngine(cfg, model, config, tok, proposers={})
    head = load_eagle_proposer("eagle3", str(ROOT / "heads/smollm2-135m-instruct-eagle3"), model, config,
                               probe.runner.num_blocks, cfg.cache.block_size, device)
    del probe
    engine = LLMEngine(cfg, model, config, tok, proposers={"eagle3": head})
    with open(args.data) as f:
        questions = [json.loads(line)["turns"][0] for line in f if line.strip()][:args.num_prompts]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), SpecParams("eagle3", 3))  # warm-up
    k3 = SpecParams("eagle3", 3)
    rows = [("plain", SPEC_OFF, None), ("eagle3_k3", k3, None)] + [
        (f"adaptive_probe_steps_{n}", k3, int(n)) for n in args.probe_steps.split(",")]
    tok_s: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    same: dict[str, bool] = {}
    snapshots: dict[str, dict] = {}
    plain_out = None
    for _ in range(args.repeats):  # interleaved: each repeat runs every row once
        for name, spec, probe_steps in rows:
            policy = SpecPolicy(caps=(0, 1), probe_steps=probe_steps) if probe_steps else None
            engine.set_spec_policy(policy)
            t0 = time.perf_counter()
            reqs = engine.generate(prompts, params, spec)
            seconds = time.perf_counter() - t0
            outs = [r.output_ids for r in reqs]
            plain_out = outs if name == "plain" else plain_out
            same[name] = same.get(name, True) and outs == plain_out
            tok_s[name].append(sum(map(len, outs)) / seconds)
            if policy is not None:
                snapshots[name] = policy.snapshot()
    base = statistics.median(tok_s["plain"])
    result = {"command": " ".join(["python", *sys.argv]), "machine": {"platform": platform.platform(),
              "cores": torch.get_num_threads(), "torch": torch.__version__},
              "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "rows": {name: {"tok_s_per_repeat": v, "median_tok_s": statistics.median(v),
                              "vs_plain": statistics.median(v) / base, "output_equals_plain": same[name],
                              "policy": snapshots.get(name)} for name, v in tok_s.items()}}
    for name, row in result["rows"].items():
        print(f"{name:26s} {row['median_tok_s']:7.1f} tok/s  x{row['vs_plain']:.3f}  same {row['output_equals_plain']}")
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
