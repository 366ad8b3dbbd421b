"""Plain CPU decoding of the default model, this checkout against an earlier commit, side by side in one run.

The baseline commit is checked out into a temporary git worktree; each repeat runs both trees once, alternating,
in fresh subprocesses (same venv and model file; each tree's CPU kernels built once, untimed), and times the greedy
generation of ``--max-tokens`` tokens for two MT-Bench prompts one at a time after a warm-up. Wall-clock tok/s and
tok/s per CPU-second (user + system of the process, both cores) are reported; the JSON keeps every repeat and the
medians.

    .venv/bin/python benchmarks/cpu_decode_ab.py --baseline REV [--repeats 8] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specserve.bench.machine import machine_info
from specserve.models.fetch import cache_dir

ROOT = Path(__file__).resolve().parent.parent

# Runs inside each tree (cwd and PYTHONPATH = the tree): prints one JSON line.
CHILD = r"""
import json, sys, time, torch
from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.engine.engine import LLMEngine
from specserve.models.loader import load_model
from specserve.sampling import SamplingParams
data_dir, max_tokens = sys.argv[1], int(sys.argv[2])
parts = load_model("default", "float32", torch.device("cpu"), 2048)
tok = parts[2]
rows = [json.loads(line) for line in open(f"{data_dir}/mt_bench/question.jsonl") if line.strip()][:2]
ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}])) for r in rows]
cfg = EngineConfig(cache=CacheConfig(kv_cache_memory_gib=1.0),
                   scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2048, max_model_len=2048))
engine = LLMEngine(cfg, *parts)
engine.generate(ids[:1], SamplingParams(max_tokens=8, temperature=0.0))
params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
cpu, wall = time.process_time(), time.perf_counter()
reqs = engine.generate(ids, params)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
n = sum(len(r.output_ids) for r in reqs)
print(json.dumps({"tokens": n, "tok_s": n / wall, "tok_per_cpu_s": n / cpu, "outputs": [r.output_ids for r in reqs]}))
"""


def run_tree(tree: Path, cache: Path, data_dir: str, max_tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "SPECSERVE_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", CHILD, data_dir, str(max_tokens)], cwd=tree, env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the commit to compare against")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--data-dir", default=os.environ.get("SPECSERVE_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_decode_ab.json"))
    args = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", args.baseline], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    runs: dict[str, list[dict]] = {"baseline": [], "current": []}
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), rev], cwd=ROOT, check=True)
        # Each tree builds its CPU kernels once into a cache of its own (a build is keyed by its sources' path, so a
        # shared cache would rebuild on every switch); both share the cached model file.
        trees = {}
        for name, tree in (("baseline", base_tree), ("current", ROOT)):
            cache = Path(tmp) / f"{name}-cache"
            cache.mkdir()
            (cache / "models").symlink_to(cache_dir() / "models")
            trees[name] = (tree, cache)
        try:
            for tree, cache in trees.values():  # untimed: builds the kernels
                run_tree(tree, cache, args.data_dir, 8)
            for i in range(args.repeats):
                for name, (tree, cache) in trees.items():
                    r = run_tree(tree, cache, args.data_dir, args.max_tokens)
                    runs[name].append(r)
                    print(f"repeat {i} {name:8s}: {r['tok_s']:6.1f} tok/s, {r['tok_per_cpu_s']:5.1f} per CPU-second",
                          flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=True)
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in ("tok_s", "tok_per_cpu_s")}
               for name, rs in runs.items()}
    same = all(r["outputs"] == runs["baseline"][0]["outputs"] for rs in runs.values() for r in rs)
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine_info(),
              "baseline": rev, "current": head, "max_tokens": args.max_tokens,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "outputs_equal": same, "medians": medians,
              "ratio_current_over_baseline": {k: medians["current"][k] / medians["baseline"][k]
                                              for k in ("tok_s", "tok_per_cpu_s")},
              "runs": {name: [{k: v for k, v in r.items() if k != "outputs"} for r in rs]
                       for name, rs in runs.items()}}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"medians": medians, "ratio": report["ratio_current_over_baseline"], "outputs_equal": same}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
