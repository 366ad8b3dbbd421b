"""Speculative decoding on CPU: what drafting and verification cost and what they buy, in one run.

Output tokens/s, mean acceptance length (AL) and acceptance rate of SmolLM2-135M-Instruct (the default model,
fp32 on CPU) at batch 1 and 8, greedy, for each method:

    none      plain decoding (the baseline every ratio divides by)
    ngram     prompt lookup, num_spec_tokens 4
    draft     the target drafting for itself (AL is k + 1; it shows the cost of a draft model as big as the target)
    eagle3    a random EAGLE-3 head (acceptance ~0: the pure cost of a head that drafts and is rejected)
    peagle    a random P-EAGLE head (same, one forward per round)

on two workloads: "verbatim" asks the model to repeat a HumanEval function stub word for word (n-gram
acceptance is high there, the case prompt lookup is for) and "mt_bench" (first turns, chat). Greedy
speculation is lossless, so every method must produce exactly the baseline's tokens; the script checks that
and records it. EOS ends a request as in serving. Writes JSON under benchmarks/results/ and prints a table.

    .venv/bin/python benchmarks/spec_cpu.py
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

from specserve.bench.machine import machine_info

ROOT = Path(__file__).resolve().parent.parent
METHODS = {"none": None, "ngram": None, "draft": "self", "eagle3": "dummy", "peagle": "dummy"}


def verbatim_prompts(data_dir: Path) -> list[str]:
    rows = [json.loads(line) for line in gzip.open(data_dir / "humaneval" / "HumanEval.jsonl.gz", "rt") if line]
    return [f"Repeat the following Python code exactly as written, with no changes and no explanation.\n\n"
            f"```python\n{r['prompt'].strip()}\n```" for r in rows]


def mt_bench_prompts(data_dir: Path) -> list[str]:
    rows = [json.loads(line) for line in (data_dir / "mt_bench" / "question.jsonl").read_text().splitlines() if line]
    return [r["turns"][0] for r in rows]


def run(parts, method: str, k: int, batch: int, prompt_ids: list[list[int]], max_tokens: int) -> dict:
    import torch

    from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from specserve.engine.engine import LLMEngine
    from specserve.sampling import SamplingParams

    spec = SpecConfig(method=method, model=METHODS[method], num_spec_tokens=k) if method != "none" else SpecConfig()
    cfg = EngineConfig(cache=CacheConfig(kv_cache_memory_gib=1.0), speculative=spec,
                       scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=2048, max_model_len=2048))
    engine = LLMEngine(cfg, *parts)
    engine.generate(prompt_ids[:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    reqs = engine.generate(prompt_ids, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in reqs)
    drafts = sum(r.spec_counters.num_drafts for r in reqs)
    drafted = sum(r.spec_counters.num_draft_tokens for r in reqs)
    accepted = sum(r.spec_counters.num_accepted_tokens for r in reqs)
    return {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "outputs": [r.output_ids for r in reqs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--workloads", default="verbatim,mt_bench")
    ap.add_argument("--num-spec-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--num-prompts", type=int, default=8, help="per workload and batch size")
    ap.add_argument("--data-dir", default=os.environ.get("SPECSERVE_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_cpu.json"))
    args = ap.parse_args()

    import torch

    from specserve.models.loader import load_model

    parts = load_model("default", "float32", torch.device("cpu"), 2048)
    tokenizer = parts[2]
    data_dir = Path(args.data_dir)
    sources = {"verbatim": verbatim_prompts, "mt_bench": mt_bench_prompts}
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine_info(),
              "model": "SmolLM2-135M-Instruct (Q4_1 GGUF), float32, CPU kernels", "greedy": True,
              "max_tokens": args.max_tokens, "num_spec_tokens": args.num_spec_tokens,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": {}}
    print(f"{'workload':>9} {'batch':>5} {'method':>7} | {'tok/s':>7} | {'vs none':>7} | {'AL':>5} | {'accept':>6} | same")
    for workload in args.workloads.split(","):
        texts = sources[workload](data_dir)[:args.num_prompts]
        prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]))
                      for t in texts]
        for batch in (int(b) for b in args.batches.split(",")):
            base = None
            for method in args.methods.split(","):
                r = run(parts, method, args.num_spec_tokens, batch, prompt_ids, args.max_tokens)
                outputs = r.pop("outputs")
                if method == "none":
                    base = (r["output_tok_s"], outputs)
                r["speedup_vs_none"] = r["output_tok_s"] / base[0] if base else None
                r["output_equals_none"] = outputs == base[1] if base else None
                report["results"].setdefault(workload, {}).setdefault(str(batch), {})[method] = r
                al = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
                acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
                ratio = f"{r['speedup_vs_none']:.2f}x" if r["speedup_vs_none"] else "-"
                print(f"{workload:>9} {batch:>5} {method:>7} | {r['output_tok_s']:>7.1f} | {ratio:>7} | {al:>5} | "
                      f"{acc:>6} | {r['output_equals_none']}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
