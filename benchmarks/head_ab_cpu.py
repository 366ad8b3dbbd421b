"""Two or more EAGLE-3 heads side by side on this CPU: mean acceptance length per evaluation set, at each asked
temperature (seeded), same prompts, same engine, one run. Used for what the GPU evaluation could not cover in a
session, e.g. sampled acceptance of a newly shipped head against the one it replaced (Leviathan et al.,
arXiv 2211.17192: the verifier is lossless at any temperature, so only acceptance may differ between heads).

A head is ``NAME=DIR`` or ``NAME=REV:PATH`` (a git revision's copy of a head directory, extracted for the run):

    .venv/bin/python benchmarks/head_ab_cpu.py --heads new=heads/smollm2-135m-instruct-eagle3 \\
        old=47c1198~1:heads/smollm2-135m-instruct-eagle3 --temperatures 0.7 --num-prompts 40 --max-tokens 128

AL = 1 + accepted drafts / verify steps (DESIGN.md). Greedy outputs must be equal across heads (checked).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from specserve.bench.datasets import load_prompts, select_prompts
from specserve.bench.machine import machine_info
from specserve.bench.stats import acceptance_from_counts
from specserve.config import HEAD_CPU_QUANTS, CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specserve.engine.engine import LLMEngine
from specserve.models.loader import load_model
from specserve.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def head_dir(spec: str, scratch: Path) -> Path:
    """``DIR`` as is, or ``REV:PATH`` extracted from git into ``scratch``."""
    if Path(spec).is_dir():
        return Path(spec)
    rev, sep, path = spec.partition(":")
    if not sep:
        raise SystemExit(f"--heads: {spec} is neither a directory nor REV:PATH")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, path], capture_output=True)
    if archive.returncode:
        raise SystemExit(f"--heads: git archive {rev} {path}: {archive.stderr.decode().strip()}")
    dst = scratch / rev.replace("~", "_").replace("/", "_")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dst, filter="data")
    return dst / path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", nargs="+", required=True, help="NAME=DIR or NAME=REV:PATH, two or more")
    ap.add_argument("--sets", nargs="+", default=["mt_bench", "humaneval", "gsm8k"])
    ap.add_argument("--num-prompts", type=int, default=40, help="the first N prompts of each set")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--seed", type=int, default=0, help="each request's sampling seed (sampled runs)")
    ap.add_argument("--num-spec-tokens", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--head-cpu-quant", choices=HEAD_CPU_QUANTS, default="q8_0")
    ap.add_argument("--data-dir", default=os.environ.get("SPECSERVE_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "head_ab_cpu.json"))
    args = ap.parse_args()
    named = [h.partition("=") for h in args.heads]
    if len(named) < 2 or any(not sep or not name for name, sep, _ in named):
        raise SystemExit("--heads: give two or more NAME=DIR (or NAME=REV:PATH)")

    parts = load_model("default", "float32", torch.device("cpu"), 2048)
    tokenizer = parts[2]
    sets = {s: select_prompts(load_prompts(s, args.data_dir), args.num_prompts) for s in args.sets}
    flat = [(s, tokenizer.encode(tokenizer.apply_chat_template(p.messages))) for s, ps in sets.items() for p in ps]
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine_info(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "heads": {n: spec for n, _, spec in named},
              "num_spec_tokens": args.num_spec_tokens, "max_tokens": args.max_tokens, "seed": args.seed,
              "head_cpu_quant": args.head_cpu_quant, "num_prompts": {s: len(ps) for s, ps in sets.items()},
              "results": {}}
    greedy_outputs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, _, spec in named:
            spec_cfg = SpecConfig(method="eagle3", model=str(head_dir(spec, Path(scratch))),
                                  num_spec_tokens=args.num_spec_tokens, head_cpu_quant=args.head_cpu_quant)
            cfg = EngineConfig(cache=CacheConfig(kv_cache_memory_gib=1.0), speculative=spec_cfg,
                               scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
                                                         max_model_len=2048))
            engine = LLMEngine(cfg, *parts)
            for temperature in args.temperatures:
                params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                        seed=None if temperature == 0 else args.seed)
                start = time.perf_counter()
                reqs = engine.generate([ids for _, ids in flat], params)
                seconds = time.perf_counter() - start
                per = {}
                for s in sets:
                    rs = [r for (rs_set, _), r in zip(flat, reqs) if rs_set == s]
                    per[s] = acceptance_from_counts(*(sum(getattr(r.spec_counters, f) for r in rs) for f in (
                        "num_drafts", "num_draft_tokens", "num_accepted_tokens")))
                    per[s]["output_tokens"] = sum(len(r.output_ids) for r in rs)
                per["seconds"] = seconds
                report["results"].setdefault(name, {})[f"T={temperature:g}"] = per
                if temperature == 0:
                    greedy_outputs[name] = [r.output_ids for r in reqs]
                print(f"{name} T={temperature:g}: " + ", ".join(
                    f"{s} AL {per[s]['mean_acceptance_length']:.3f}" for s in sets) + f" ({seconds:.0f} s)", flush=True)
            del engine
    if len(greedy_outputs) > 1:
        first = next(iter(greedy_outputs.values()))
        report["greedy_outputs_equal"] = all(o == first for o in greedy_outputs.values())
        print(f"greedy outputs equal across heads: {report['greedy_outputs_equal']}")
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
