"""Seeded sampling with and without speculation on the real model (GPU machine, or CPU for a wiring check): the
SmolLM2 target and the committed EAGLE-3 head as ``train_heads_gpu.py speed`` loads them (run its ``stage`` calls
first). For each evaluation set, the first ``--prompts`` prompts, all at once, each with its own seed
(temperature 0.7, top-p 0.95): plain decoding, EAGLE-3 with k = 3 and the adaptive policy. With the
position-coupled verifier (``spec/verify.py``) a speculative run draws the same tokens as the plain one up to
where the verify forward's bf16 logits round differently from the decode forward's; the same comparison for
greedy decoding shows what that rounding does without sampling. Reports, per set and row, the fraction of
requests whose output is identical to plain decoding's, the median position of the first difference among the
others, and output tokens/s. Writes $OUT/seeded_spec.json.

    python benchmarks/seeded_spec_gpu.py --prompts 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.train_heads_gpu as th  # noqa: E402
from benchmarks.gpu_engine import sync  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.spec.params import SPEC_OFF, SpecParams  # noqa: E402
from specserve.spec.policy import SpecPolicy  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two outputs differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(engine, prompts, params, spec, adaptive: bool) -> tuple[list[list[int]], float, int]:
    engine.set_spec_policy(SpecPolicy(caps=(0, 1)) if adaptive else None)
    sync(engine.device)
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params, spec)
    sync(engine.device)
    seconds = time.perf_counter() - t0
    accepted = sum(r.spec_counters.num_accepted_tokens for r in reqs)
    return [r.output_ids for r in reqs], seconds, accepted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--sets", default="mt_bench,humaneval,gsm8k")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--gsm8k-limit", type=int, default=200)
    ap.add_argument("--eagle3-head", default="heads/smollm2-135m-instruct-eagle3")
    args = ap.parse_args()
    engine, ids = th.eval_engine(args, {"eagle3": th.ROOT / args.eagle3_head})
    k3 = SpecParams("eagle3", 3)
    warm = ids["mt_bench"][-4:]
    for spec in (SPEC_OFF, SpecParams("eagle3", 1), SpecParams("eagle3", 2), k3):  # graphs and kernels
        engine.generate(warm, SamplingParams(max_tokens=32, temperature=0.7, seed=0), spec)
    result = {"command": " ".join(["python", *sys.argv]),
              "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device, "sets": {}}
    for name in args.sets.split(","):
        prompts = ids[name][:args.prompts]
        sampled = [SamplingParams(max_tokens=args.max_tokens, temperature=0.7, top_p=0.95, seed=1000 + i)
                   for i in range(len(prompts))]
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        rows = {}
        for mode, params in (("sampled", sampled), ("greedy", greedy)):
            base, base_s, _ = run(engine, prompts, params, SPEC_OFF, False)
            tokens = sum(len(o) for o in base)
            rows[f"{mode}_plain"] = {"tok_s": tokens / base_s}
            for row, adaptive in (("eagle3_k3", False), ("eagle3_k3_adaptive", True)):
                outs, seconds, accepted = run(engine, prompts, params, k3, adaptive)
                diffs = [first_difference(o, b) for o, b in zip(outs, base)]
                differing = [d for d in diffs if d is not None]
                rows[f"{mode}_{row}"] = {
                    "identical_fraction": 1 - len(differing) / len(diffs),
                    "first_difference_median": statistics.median(differing) if differing else None,
                    "first_differences": differing, "tok_s": sum(len(o) for o in outs) / seconds,
                    "accepted_tokens": accepted}
            print(name, mode, {k: {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in v.items()
                                   if kk != "first_differences"} for k, v in rows.items() if k.startswith(mode)},
                  flush=True)
        result["sets"][name] = rows
    engine.set_spec_policy(None)
    th.OUT.mkdir(parents=True, exist_ok=True)
    (th.OUT / "seeded_spec.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
