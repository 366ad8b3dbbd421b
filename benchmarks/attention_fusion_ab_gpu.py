"""One of TritonAttentionBackend's launch fusions on against off, side by side on one GPU (GPU machine, not CI):

- ``--attr fuses_rope``: rope fused into the KV-cache write (``_rope_write_kv_kernel``, one launch per layer and
  step) against the layer's rope op + ``_write_kv_kernel`` (two launches);
- ``--attr last_split_combines`` (391d2b7 only; removed after its run, split_merge_ab_h200.json): split decode
  merged by the last split program to finish (arrival counters in ``_decode_kernel``) against
  ``_combine_splits_kernel`` launched after it.

The arm "fused" sets the class attribute True, "unfused" False, for the arm's engines (their CUDA graphs capture
the launches as they were). Arms alternate in order each round (``--rounds``); each number is a median over the
rounds' medians.

- ``decode``: the engine's median decode step and its graph replay on the Llama-3.1-8B shape (dummy weights), bf16
  and FP8 (``--quantization``), at ``--batches``;
- ``e2e``: SmolLM2-135M shape (dummy weights) offline greedy generate of ``--new-tokens`` at concurrency 1, output
  tokens/s, and whether the two arms generated the same tokens (for fuses_rope they must: the fused kernel rounds
  as the op; 391d2b7's in-kernel merge summed the splits in another order, so its tokens could differ).

    python benchmarks/attention_fusion_ab_gpu.py --attr fuses_rope --out $OUT/rope_fusion_ab_gpu.json
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

import benchmarks.gpu_engine as ge  # noqa: E402
from specserve.layers.triton_attention import TritonAttentionBackend  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402

ARMS = ("fused", "unfused")


def with_arm(attr: str, arm: str, fn, *args):
    """``fn(*args)`` with the backend's fusion ``attr`` on (``fused``) or off (``unfused``)."""
    saved = getattr(TritonAttentionBackend, attr)
    setattr(TritonAttentionBackend, attr, arm == "fused")
    try:
        return fn(*args)
    finally:
        setattr(TritonAttentionBackend, attr, saved)


def decode_arm(model, config, args, device: torch.device) -> dict:
    engine = ge.engine_for(model, config, device, max(args.batches), args.kv_gib, args.max_model_len, 8192,
                           proposers={})
    out = {}
    for b in args.batches:
        r = ge.time_decode_steps(engine, device, b, args.prompt_len, args.steps)
        out[str(b)] = {k: r[k] for k in ("median_step_s", "graph_replay_s")}
    del engine
    ge.free(device)
    return out


def e2e_arm(model, config, args, device: torch.device) -> dict:
    max_len = args.e2e_prompt_len + args.new_tokens + 32
    engine = ge.engine_for(model, config, device, 1, 2.0, max_len, 4096, proposers={})
    params = ge.SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(ge.random_prompts(1, args.e2e_prompt_len, config.vocab_size, seed=99),
                    ge.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), ge.SPEC_OFF)  # warm-up
    prompts = ge.random_prompts(1, args.e2e_prompt_len, config.vocab_size, seed=1)
    ge.sync(device)
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params, ge.SPEC_OFF)
    ge.sync(device)
    dt = time.perf_counter() - t0
    del engine
    ge.free(device)
    return {"tok_s": len(reqs[0].output_ids) / dt, "output_ids": reqs[0].output_ids}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--attr", default="fuses_rope", choices=("fuses_rope",),
                    help="the TritonAttentionBackend class attribute the arms set (see the docstring)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--quantization", default="bf16,fp8", help="comma list of bf16 / fp8 / int4")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.prompt_len, args.e2e_prompt_len, args.max_model_len, args.kv_gib = 512, 128, 1024, 12.0
    device = torch.device("cuda")
    dtype = torch.bfloat16
    report: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
                    "torch": torch.__version__, "attr": args.attr, "rounds": args.rounds, "decode": {}, "e2e": {}}

    def orders():
        return [ARMS if r % 2 == 0 else ARMS[::-1] for r in range(args.rounds)]

    config = shape_config("llama-3.1-8b")
    for quant in args.quantization.split(","):
        model = ge.dummy_model(config, args.max_model_len, dtype, device)
        if quant != "bf16":
            ge.quantize_model(model, quant)
            ge.free(device)
        runs: dict = {arm: [] for arm in ARMS}
        for order in orders():
            for arm in order:
                runs[arm].append(with_arm(args.attr, arm, decode_arm, model, config, args, device))
        res = {arm: {str(b): {k: statistics.median(run[str(b)][k] for run in runs[arm])
                              for k in ("median_step_s", "graph_replay_s")} for b in args.batches}
               for arm in ARMS}
        res["unfused_over_fused"] = {str(b): res["unfused"][str(b)]["median_step_s"]
                                     / res["fused"][str(b)]["median_step_s"] for b in args.batches}
        res["runs"] = runs
        report["decode"][quant] = res
        print(quant, json.dumps({k: v for k, v in res.items() if k != "runs"}), flush=True)
        del model
        ge.free(device)

    small = shape_config("smollm2-135m")
    model = ge.dummy_model(small, args.e2e_prompt_len + args.new_tokens + 96, dtype, device)
    runs = {arm: [] for arm in ARMS}
    for order in orders():
        for arm in order:
            runs[arm].append(with_arm(args.attr, arm, e2e_arm, model, small, args, device))
    e2e = {arm: statistics.median(r["tok_s"] for r in runs[arm]) for arm in ARMS}
    e2e["fused_over_unfused"] = e2e["fused"] / e2e["unfused"]
    e2e["same_tokens"] = all(r["output_ids"] == runs["unfused"][0]["output_ids"] for arm in ARMS for r in runs[arm])
    e2e["tok_s_runs"] = {arm: [r["tok_s"] for r in runs[arm]] for arm in ARMS}
    report["e2e"] = e2e
    print("e2e", json.dumps(e2e), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
