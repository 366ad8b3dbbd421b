"""Engine acceptance vs the trainer's teacher-forced estimate on the same sequences: a train/serve mismatch check
for an EAGLE-3 or P-EAGLE head (CPU, fp32, the default model; not CI).

    python benchmarks/eagle_tf_check.py HEAD_DIR [--prompts 10] [--max-tokens 128]
    python benchmarks/eagle_tf_check.py heads/smollm2-135m-instruct-peagle --method peagle --ks 1,2,3,7

For the first ``--prompts`` prompts of MT-Bench (first turns), HumanEval and GSM8K test, the engine answers greedily
with the head at each k of ``--ks`` (mean acceptance length from the engine's counters); then ``Trainer.evaluate``
runs on exactly those prompt + answer sequences (P-EAGLE: at every position, as anchors). Equal numbers mean the head
sees in serving what it saw in training. The engine drafts only right after each verify step (often just after a
rejected, hard token), while the estimate averages over every position, so at k > 1 the engine may fall somewhat
below it without any mismatch.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, TrainDraftConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.models.fetch import default_model_path  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.spec.eagle3 import load_eagle_proposer  # noqa: E402
from specserve.spec.params import SpecParams  # noqa: E402
from specserve.train.generate import Sample  # noqa: E402
from specserve.train.trainer import Trainer, TrainOps  # noqa: E402

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def read_jsonl(path: Path) -> list[dict]:
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        return [json.loads(line) for line in f if line.strip()]


def eval_prompts(n: int) -> dict[str, list[str]]:
    return {
        "mt_bench": [r["turns"][0] for r in read_jsonl(DATA / "mt_bench/question.jsonl")][:n],
        "humaneval": ["Complete the following Python function.\n\n" + r["prompt"]
                      for r in read_jsonl(DATA / "humaneval/HumanEval.jsonl.gz")][:n],
        "gsm8k": [r["question"] for r in read_jsonl(DATA / "gsm8k/test.jsonl")][:n],
    }


def cpu_engine_with_head(method: str, head_dir: str, device: torch.device, speculate: bool = True):
    """(model, config, tokenizer, engine, proposer): the default model in fp32 on CPU and the head loaded as its
    ``method`` proposer; the engine serves it (``speculate``) or runs without proposers."""
    model, config, tok = load_model(str(default_model_path()), "float32", device, 2048)
    engine_cfg = EngineConfig(device="cpu", cache=CacheConfig(kv_cache_memory_gib=1.0),
                              scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096,
                                                        max_model_len=2048))
    probe = LLMEngine(engine_cfg, model, config, tok, proposers={})
    proposer = load_eagle_proposer(method, head_dir, model, config, probe.runner.num_blocks, 16, device)
    if not speculate:
        return model, config, tok, probe, proposer
    del probe
    return model, config, tok, LLMEngine(engine_cfg, model, config, tok, proposers={method: proposer}), proposer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head", help="EAGLE-3 head directory (speculators format)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--method", choices=["eagle3", "peagle"], default="eagle3")
    ap.add_argument("--ks", default="1,5", help="draft lengths to compare, comma-separated (at most 7)")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    device = torch.device("cpu")
    model, config, tok, engine, proposer = cpu_engine_with_head(args.method, args.head, device)
    head = proposer.head
    draft_ids = torch.arange(len(head.d2t)) + head.d2t.long()  # d2t holds draft index -> target id offsets
    # P-EAGLE: every answer position an anchor (an answer here is at most max_tokens long)
    trainer = Trainer(model, config, TrainDraftConfig(method=args.method, ttt_steps=7, num_spec_tokens=7,
                                                      anchors_per_seq=args.max_tokens, anchor_chunk=32,
                                                      max_batch_tokens=1024),
                      draft_ids, device, Path("/tmp/eagle_tf_check"), progress=False)
    head.set_ops(TrainOps())
    trainer.head = head  # evaluate the served head itself
    results = {}
    for name, prompts in eval_prompts(args.prompts).items():
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
        row = {}
        for k in ks:
            reqs = engine.generate(ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
                                   SpecParams(args.method, k))
            drafts = sum(r.spec_counters.num_drafts for r in reqs)
            accepted = sum(r.spec_counters.num_accepted_tokens for r in reqs)
            row[f"engine_k{k}"] = round(1 + accepted / max(drafts, 1), 3)
        est = trainer.evaluate([Sample(list(i) + list(r.output_ids), len(i)) for i, r in zip(ids, reqs)])
        row |= {f"teacher_forced_k{k}": round(est["estimated_al"][k], 3) for k in ks}
        row["teacher_forced_acc_per_pos"] = [round(a, 3) for a in est["acc_per_pos"]]
        results[name] = row
        print(name, row, flush=True)
    print(json.dumps({"command": " ".join(["python", *sys.argv]), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
