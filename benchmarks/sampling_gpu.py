"""What sampled decoding costs against greedy at high concurrency (GPU machine, not CI): output tokens/s of our
engine on the SmolLM2-135M shape (random weights, bf16, no speculation) for the same prompts answered greedily,
at temperature 0.7 with a seed per request, and at temperature 0.7 unseeded, side by side in one run. A diagnostic
for the draft-data generator (``train/generate.py`` samples a share of its answers); it asserts nothing.
``--ab-triton`` runs each sampled kind a second time with the sampler's filter and draw in their torch form
(``*_torch``); every kind is run once untimed first, then ``--rounds`` times interleaved (median).

    python benchmarks/sampling_gpu.py --concurrency 1,32,256 --ab-triton --rounds 3 --out $OUT/sampling.json
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
    ap.add_argument("--ab-triton", action="store_true",
                    help="also run each sampled kind with SPECSERVE_DISABLE_TRITON_SAMPLER (torch filter and draw)")
    ap.add_argument("--rounds", type=int, default=1, help="timed runs per kind and concurrency, interleaved (median)")
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
    # the same sampled kinds again with the filter and draw in their torch form (layers/triton_sampler.py's A/B)
    torch_form = {f"{k}_torch": make for k, make in kinds.items() if k != "greedy"} if args.ab_triton else {}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"command": " ".join(["python", *sys.argv]), "gpu": gpu,
           "shape": "smollm2-135m", "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "by_kind": {}}
    everything = {**kinds, **torch_form}

    def run(kind: str, prompts: list, c: int) -> tuple[int, float]:
        if kind.endswith("_torch"):
            os.environ[DISABLE_TRITON_SAMPLER_ENV] = "1"
        try:
            ge.sync(device)
            t0 = time.perf_counter()
            reqs = engine.generate(prompts, [everything[kind](i) for i in range(c)], SPEC_OFF)
            ge.sync(device)
            return sum(len(r.output_ids) for r in reqs), time.perf_counter() - t0
        finally:
            os.environ.pop(DISABLE_TRITON_SAMPLER_ENV, None)

    for c in conc:
        prompts = ge.random_prompts(c, args.prompt_len, config.vocab_size, seed=c)
        for kind in everything:  # warm-up: Triton compiles, graphs capture, first use of each op
            run(kind, prompts, c)
        runs: dict[str, list] = {kind: [] for kind in everything}
        for _ in range(args.rounds):
            for kind in everything:
                runs[kind].append(run(kind, prompts, c))
        for kind, rs in runs.items():
            n, dt = sorted(rs, key=lambda r: r[0] / r[1])[len(rs) // 2]
            out["by_kind"].setdefault(kind, {})[str(c)] = {"tok_s": n / dt, "seconds": dt, "output_tokens": n,
                                                           "tok_s_rounds": [r[0] / r[1] for r in rs]}
            print(f"c={c:4d} {kind:28s} {n / dt:9.0f} tok/s ({dt:.2f} s)", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
