"""How much of the target's output a draft vocabulary covers, per evaluation set (CPU, the real default model).

A draft token outside the head's draft vocabulary can never be proposed, so a chain stops at the first such
target token. This script generates greedy answers with the shipped EAGLE-3 head (also reporting its AL), and
for each set gives the share of output tokens outside the head's own vocabulary and outside the top-N
vocabularies the training samples would give (``train/vocab.py``, the rule ``specserve train-draft`` uses).

    python benchmarks/draft_vocab_coverage.py --samples .carry/d/gen_s11 .carry/d/gen .carry/d/gen_s10 \
        --out benchmarks/results/draft_vocab_coverage.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specserve.bench.datasets import load_prompts  # noqa: E402
from specserve.bench.machine import machine_info  # noqa: E402
from specserve.models.fetch import DEFAULT_EAGLE3_HEAD  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", nargs="+", required=True, help="directories with data_train.npz (training samples)")
    ap.add_argument("--head", default=str(DEFAULT_EAGLE3_HEAD))
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-spec-tokens", type=int, default=5)
    ap.add_argument("--vocab-sizes", default="8192,16384,32768")
    ap.add_argument("--data-dir", default=os.environ.get("SPECSERVE_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "draft_vocab_coverage.json"))
    args = ap.parse_args()

    from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from specserve.engine.engine import LLMEngine
    from specserve.models.loader import load_model
    from specserve.sampling import SamplingParams
    from specserve.spec.eagle_checkpoint import load_eagle_head
    from specserve.train.generate import load_samples
    from specserve.train.vocab import draft_vocab, token_counts

    device = torch.device("cpu")
    parts = load_model("default", "float32", device, 1024)
    model_config, tokenizer = parts[1], parts[2]
    head = load_eagle_head(args.head, model_config.num_hidden_layers, model_config.vocab_size, 2048, torch.float32,
                           device)
    head_vocab = set((head.d2t + torch.arange(len(head.d2t))).tolist())
    samples = [s for d in args.samples for s in load_samples(Path(d) / "data_train.npz")]
    counts = token_counts(samples, model_config.vocab_size)
    vocabs = {int(v): set(draft_vocab(counts, int(v)).tolist()) for v in args.vocab_sizes.split(",")}
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=1024),
                       speculative=SpecConfig(method="eagle3", model=args.head, num_spec_tokens=args.num_spec_tokens),
                       scheduler=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=2048,
                                                 max_num_seqs=args.num_prompts))
    engine = LLMEngine(cfg, *parts)
    report = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(), "head": args.head,
              "head_draft_vocab_size": len(head_vocab), "num_training_samples": len(samples),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "sets": {}}
    for name in ("mt_bench", "gsm8k"):  # first turns / questions, as `specserve bench` sends them
        prompts = load_prompts(name, args.data_dir)[:args.num_prompts]
        ids = [tokenizer.encode(tokenizer.apply_chat_template(p.messages)) for p in prompts]
        reqs = engine.generate(ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
        out = [t for r in reqs for t in r.output_ids]
        drafts = sum(r.spec_counters.num_drafts for r in reqs)
        accepted = sum(r.spec_counters.num_accepted_tokens for r in reqs)
        row = {"output_tokens": len(out), "mean_acceptance_length": 1 + accepted / max(drafts, 1),
               "outside_head_vocab": sum(t not in head_vocab for t in out) / len(out),
               "outside_top_n": {str(v): sum(t not in s for t in out) / len(out) for v, s in vocabs.items()}}
        report["sets"][name] = row
        print(name, json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
