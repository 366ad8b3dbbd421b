"""Speculative decoding on CPU: what drafting and verification cost and what they buy, in one run.

Output tokens/s, mean acceptance length (AL) and acceptance rate of SmolLM2-135M-Instruct (the default model,
fp32 on CPU) at batch 1 and 8, greedy, for each method:

    none      plain decoding (the baseline every ratio divides by)
    ngram     prompt lookup, num_spec_tokens 4
    draft     the target drafting for itself (AL is k + 1; it shows the cost of a draft model as big as the target)
    eagle3    a random EAGLE-3 head (acceptance ~0: the pure cost of a head that drafts and is rejected)
    eagle3_trained  the EAGLE-3 head the repository ships (heads/, `make serve`'s drafter)
    peagle    a random P-EAGLE head (same, one forward per round)
    <method>_fp32head  an EAGLE-3 / P-EAGLE head with its float32 weights (by default a CPU head runs from
              Q8_0 blocks of them, ``SpecConfig.head_cpu_quant``), e.g. eagle3_trained_fp32head
    <method>_adaptive  the same with adaptive speculation (``--spec-adaptive``: each step's draft cap chosen
              from measured goodput per batch size, spec/policy.py), e.g. eagle3_trained_adaptive

on two workloads: "verbatim" asks the model to copy a prose passage (MT-Bench's GPT-4 reference answers)
exactly, the case prompt lookup is for (the reply is prefilled with the passage's first words), and
"mt_bench" (first turns, chat). Every request generates
request ends at EOS or ``--max-tokens`` as in serving (``--ignore-eos`` makes every request run to
``--max-tokens``; SmolLM2-135M copies a passage, or part of it, then stops, so past EOS it writes its own
continuation). Greedy speculation is lossless, so every method produces exactly the baseline's tokens (the same
count, so tokens/s compare directly); the script checks that and records it. ``output_tok_s`` includes prefill
(identical work for every method); ``mean_tpot_ms`` (mean time per output token after the first) is decoding alone.
Writes JSON under benchmarks/results/ and prints a table.

    .venv/bin/python benchmarks/spec_cpu.py
    .venv/bin/python benchmarks/spec_cpu.py --workloads verbatim --batches 1 --methods none,ngram \
        --num-prompts 17 --ngram-min 2 --repeats 3     (the issue's bar: n-gram k = 4 vs none, batch 1)

``--cpu-activation-quant q8`` runs every method with int8 activations in the block-quantized kernels
(``EngineConfig.cpu_activation_quant``; recorded in the JSON); both sides of every ratio use the same setting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from specserve.bench.machine import machine_info
from specserve.config import CPU_ACTIVATION_QUANTS, SpecConfig
from specserve.models.fetch import DEFAULT_EAGLE3_HEAD

ROOT = Path(__file__).resolve().parent.parent
METHODS = {"none": None, "ngram": None, "draft": "self", "eagle3": "dummy", "peagle": "dummy",
           "eagle3_trained": str(DEFAULT_EAGLE3_HEAD)}


def verbatim_prompts(data_dir: Path) -> list[tuple[str, str]]:
    """(user message, assistant prefix) pairs: copy a prose passage (MT-Bench GPT-4 reference answers without
    code). The passage comes first, in <text> tags, then the instruction, and the reply is prefilled with the
    opening tag and the passage's first eight words, as an API prefill would: SmolLM2-135M otherwise often answers
    the passage instead of copying it. Of the layouts tried (instruction first or last, tags or none, a system
    prompt, 8 or 16 prefilled words) this one made the model copy most faithfully."""
    rows = [json.loads(line) for line in (data_dir / "mt_bench" / "reference_answer_gpt-4.jsonl").open() if line]
    passages = [t for r in rows for t in r["choices"][0]["turns"] if 300 < len(t) < 900 and "```" not in t]
    return [(f"<text>\n{p}\n</text>\n\nCopy the text above exactly.", "<text>\n" + " ".join(p.split()[:8]))
            for p in passages]


def mt_bench_prompts(data_dir: Path) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in (data_dir / "mt_bench" / "question.jsonl").read_text().splitlines() if line]
    return [(r["turns"][0], "") for r in rows]


def run(parts, method: str, k: int, batch: int, prompt_ids: list[list[int]], max_tokens: int,
        ignore_eos: bool, ngram: tuple[int, int], cpu_activation_quant: str) -> dict:
    import torch

    from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from specserve.engine.engine import LLMEngine
    from specserve.sampling import SamplingParams

    base = method.removesuffix("_adaptive")
    head_quant = "none" if base.endswith("_fp32head") else SpecConfig.head_cpu_quant
    base = base.removesuffix("_fp32head")
    spec = SpecConfig(method=base.removesuffix("_trained"), model=METHODS[base], num_spec_tokens=k,
                      ngram_min=ngram[0], ngram_max=ngram[1], head_cpu_quant=head_quant,
                      adaptive=method.endswith("_adaptive")) if method != "none" else SpecConfig()
    cfg = EngineConfig(cache=CacheConfig(kv_cache_memory_gib=1.0), speculative=spec,
                       cpu_activation_quant=cpu_activation_quant,
                       scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=2048, max_model_len=2048))
    engine = LLMEngine(cfg, *parts)
    engine.generate(prompt_ids[:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    reqs = engine.generate(prompt_ids, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in reqs)
    # Decode speed alone (prefill excluded): mean time per output token after the first, over requests.
    tpots = [(r.finished_time - r.first_token_time) / (len(r.output_ids) - 1) for r in reqs if len(r.output_ids) > 1]
    drafts = sum(r.spec_counters.num_drafts for r in reqs)
    drafted = sum(r.spec_counters.num_draft_tokens for r in reqs)
    accepted = sum(r.spec_counters.num_accepted_tokens for r in reqs)
    policy = engine.spec_policy.snapshot() if engine.spec_policy is not None else None  # goodput per arm
    return {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds, "policy": policy,
            "mean_tpot_ms": 1e3 * sum(tpots) / len(tpots),
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
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ngram-min", type=int, default=SpecConfig.ngram_min)
    ap.add_argument("--ngram-max", type=int, default=SpecConfig.ngram_max)
    ap.add_argument("--cpu-activation-quant", choices=CPU_ACTIVATION_QUANTS, default="none",
                    help="activations of the Q4_1/Q8_0 CPU kernels: none (float32) or q8 (int8 per block of 32)")
    ap.add_argument("--ignore-eos", action="store_true", help="every request generates --max-tokens tokens")
    ap.add_argument("--num-prompts", type=int, default=6, help="per workload and batch size")
    ap.add_argument("--repeats", type=int, default=1, help="run every method this many times, alternating; the "
                    "JSON keeps each repeat's ratios and reports the median one")
    ap.add_argument("--data-dir", default=os.environ.get("SPECSERVE_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_cpu.json"))
    args = ap.parse_args()

    import torch

    from specserve.models.loader import load_model

    parts = load_model("default", "float32", torch.device("cpu"), 2048, cpu_activation_quant=args.cpu_activation_quant)
    tokenizer = parts[2]
    data_dir = Path(args.data_dir)
    sources = {"verbatim": verbatim_prompts, "mt_bench": mt_bench_prompts}
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine_info(),
              "model": "SmolLM2-135M-Instruct (Q4_1 GGUF), float32, CPU kernels", "greedy": True,
              "cpu_activation_quant": args.cpu_activation_quant,
              "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "num_spec_tokens": args.num_spec_tokens,
              "ngram_min_max": [args.ngram_min, args.ngram_max],
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": {}}
    print(f"{'workload':>9} {'batch':>5} {'method':>24} | {'tok/s':>7} | {'vs none':>7} | {'TPOT ms':>7} | "
          f"{'vs none':>7} | {'AL':>5} | {'accept':>6} | same")
    for workload in args.workloads.split(","):
        texts = sources[workload](data_dir)[:args.num_prompts]
        prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]) + prefix)
                      for t, prefix in texts]
        for batch in (int(b) for b in args.batches.split(",")):
            runs: dict[str, list[dict]] = {}
            for _ in range(args.repeats):  # methods alternate: slow spells of a shared machine hit all of them
                base = None
                for method in args.methods.split(","):
                    r = run(parts, method, args.num_spec_tokens, batch, prompt_ids, args.max_tokens,
                            args.ignore_eos, (args.ngram_min, args.ngram_max), args.cpu_activation_quant)
                    outputs = r.pop("outputs")
                    if method == "none":
                        base = (r["output_tok_s"], outputs, r["mean_tpot_ms"])
                    r["speedup_vs_none"] = r["output_tok_s"] / base[0] if base else None
                    r["tpot_speedup_vs_none"] = base[2] / r["mean_tpot_ms"] if base else None
                    r["output_equals_none"] = outputs == base[1] if base else None
                    runs.setdefault(method, []).append(r)
                    al = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
                    acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
                    ratio = f"{r['speedup_vs_none']:.2f}x" if r["speedup_vs_none"] else "-"
                    tpot = f"{r['tpot_speedup_vs_none']:.2f}x" if r["tpot_speedup_vs_none"] else "-"
                    print(f"{workload:>9} {batch:>5} {method:>24} | {r['output_tok_s']:>7.1f} | {ratio:>7} | "
                          f"{r['mean_tpot_ms']:>7.1f} | {tpot:>7} | {al:>5} | {acc:>6} | "
                          f"{r['output_equals_none']}", flush=True)
            for method, rs in runs.items():  # the repeat with the median speedup, and every repeat's ratios
                key = "speedup_vs_none" if rs[0]["speedup_vs_none"] is not None else "output_tok_s"
                summary = dict(sorted(rs, key=lambda r: r[key])[len(rs) // 2])
                summary["repeats"] = len(rs)
                summary["speedup_vs_none_per_repeat"] = [r["speedup_vs_none"] for r in rs]
                summary["tpot_speedup_vs_none_per_repeat"] = [r["tpot_speedup_vs_none"] for r in rs]
                summary["output_tok_s_per_repeat"] = [r["output_tok_s"] for r in rs]
                summary["output_equals_none"] = all(r["output_equals_none"] for r in rs)
                report["results"].setdefault(workload, {}).setdefault(str(batch), {})[method] = summary
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
