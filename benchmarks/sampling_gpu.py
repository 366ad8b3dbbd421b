"""What sampled decoding costs against greedy at high concurrency (GPU machine, not CI): output tokens/s of our
engine on the SmolLM2-135M shape (random weights, bf16, no speculation) for the same prompts answered greedily,
at temperature 0.7 with a seed per request, and at temperature 0.7 unseeded, side by side in one run. A diagnostic
for the draft-data generator (``train/generate.py`` samples a share of its answers); it asserts nothing.
``--ab-draw`` runs each sampled kind a second time with the draw in its torch form (``*_torch_draw``).

    python benchmarks/sampling_gpu.py --concurrency 1,32,256 --ab-draw --out $OUT/sampling.json
    python benchmarks/sampling_gpu.py --device cpu --concurrency 4 --prompt-len 8 --new-tokens 4   # wiring
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from specserve.layers.sampler import DISABLE_TRITON_SAMPLER_ENV  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.spec.params import SPEC_OFF  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="32,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cpu: a wiring check")
    ap.add_argument("--ab-draw", action="store_true",
                    help="also run each sampled kind with SPECSERVE_DISABLE_TRITON_SAMPLER (the torch draw)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "sampling.json"))
    args = ap.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16
    config = shape_config("smollm2-135m")
    conc = [int(c) for c in args.concurrency.split(",")]
    max_len = args.prompt_len + args.new_tokens + 32
    model = ge.dummy_model(config, max_len + 64, dtype, device)
    engine = ge.engine_for(model, config, device, max(conc), 8.0, max_len, 8192)
    kinds = {"greedy": lambda i: SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True),
             "seeded_t0.7": lambda i: SamplingParams(max_tokens=args.new_tokens, temperature=0.7, seed=i,
                                                     ignore_eos=True),
             "unseeded_t0.7": lambda i: SamplingParams(max_tokens=args.new_tokens, temperature=0.7, ignore_eos=True),
             "seeded_t0.7_top_p0.9": lambda i: SamplingParams(max_tokens=args.new_tokens, temperature=0.7, top_p=0.9,
                                                              seed=i, ignore_eos=True)}
    # the same sampled kinds again with the draw in its torch form (layers/triton_sampler.py's A/B)
    torch_draw = {f"{k}_torch_draw": make for k, make in kinds.items() if k != "greedy"} if args.ab_draw else {}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"command": " ".join(["python", *sys.argv]), "gpu": gpu,
           "shape": "smollm2-135m", "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "by_kind": {}}
    for c in conc:  # warm-up: Triton compiles, graphs capture
        engine.generate(ge.random_prompts(c, args.prompt_len, config.vocab_size, seed=99),
                        [kinds["seeded_t0.7"](i) for i in range(c)], SPEC_OFF)
    for c in conc:
        prompts = ge.random_prompts(c, args.prompt_len, config.vocab_size, seed=c)
        for kind, make in {**kinds, **torch_draw}.items():
            if kind.endswith("_torch_draw"):
                os.environ[DISABLE_TRITON_SAMPLER_ENV] = "1"
            ge.sync(device)
            t0 = time.perf_counter()
            reqs = engine.generate(prompts, [make(i) for i in range(c)], SPEC_OFF)
            ge.sync(device)
            dt = time.perf_counter() - t0
            n = sum(len(r.output_ids) for r in reqs)
            os.environ.pop(DISABLE_TRITON_SAMPLER_ENV, None)
            out["by_kind"].setdefault(kind, {})[str(c)] = {"tok_s": n / dt, "seconds": dt, "output_tokens": n}
            print(f"c={c:4d} {kind:14s} {n / dt:9.0f} tok/s ({dt:.2f} s)", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
