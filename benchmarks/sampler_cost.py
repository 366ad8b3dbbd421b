"""Host / device cost of sampling a step's rows (``layers/sampler.py``): top-k / top-p filtering among a partial
top-k of candidates (``apply_top_k_top_p``) against filtering on a full sort of every row (``_filter_sorted``,
the method before), the whole ``sample_on_device`` draw, and argmax for scale, on the same synthetic logits; on
CUDA (where ``filter_candidates_ms`` is the Triton threshold path) also the torch filter, the draw alone against
its torch form (``layers/triton_sampler.py``), and ``sample_on_device`` with both torch forms
(``SPECSERVE_DISABLE_TRITON_SAMPLER``).
Median milliseconds; writes ``--out`` (JSON) with the command and the machine.

    python benchmarks/sampler_cost.py --out benchmarks/results/sampler_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.layers.sampler import (  # noqa: E402
    DISABLE_TRITON_SAMPLER_ENV,
    TokenUniforms,
    _filter_sorted,
    apply_top_k_top_p,
    draw_tokens,
    draw_tokens_reference,
    sample_on_device,
    target_probs,
)
from specserve.sampling import SamplingParams  # noqa: E402


def median_ms(fn, device: torch.device, reps: int) -> float:
    times = []
    for i in range(reps + 3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def profile_sample(logits: torch.Tensor, device: torch.device, b: int, reps: int = 10) -> list[str]:
    """torch.profiler table of ``reps`` ``sample_on_device`` calls (temperature 0.7, top-p 0.95): where the time
    goes, op by op (device time on CUDA)."""
    from torch.profiler import ProfilerActivity, profile
    params = [SamplingParams(temperature=0.7, top_p=0.95)] * b
    call = lambda: sample_on_device(logits, params, [TokenUniforms(i) for i in range(b)], TokenUniforms(0))  # noqa: E731
    for _ in range(3):
        call()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(reps):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
    print(table, flush=True)
    return table.splitlines()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler's top ops of sample_on_device (top_p 0.95) by device time")
    args = ap.parse_args()
    device = torch.device(args.device)
    b, v = args.rows, args.vocab
    logits = (torch.randn(b, v, generator=torch.Generator().manual_seed(0)) * 3).to(device)  # [rows, vocab]
    scaled = logits / 0.7
    rows = []
    for top_k, top_p in ((0, 1.0), (0, 0.95), (50, 1.0), (40, 0.9)):  # (0, 1.0): temperature only
        ks, ps = [top_k] * b, [top_p] * b
        params = [SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)] * b
        row = {"top_k": top_k, "top_p": top_p,
               "filter_candidates_ms": median_ms(lambda ks=ks, ps=ps: apply_top_k_top_p(scaled, ks, ps),
                                                 device, args.reps),
               "filter_full_sort_ms": median_ms(lambda ks=ks, ps=ps: _filter_sorted(scaled, [k or v for k in ks], ps),
                                                device, args.reps),
               "sample_on_device_ms": median_ms(
                   lambda params=params: sample_on_device(logits, params, [TokenUniforms(i) for i in range(b)],
                                                          TokenUniforms(0)), device, args.reps),
               "argmax_ms": median_ms(lambda: logits.argmax(dim=-1), device, args.reps)}
        if device.type == "cuda":  # the filter and draw in their torch form (layers/triton_sampler.py's oracles)
            os.environ[DISABLE_TRITON_SAMPLER_ENV] = "1"
            try:
                row["filter_torch_ms"] = median_ms(lambda ks=ks, ps=ps: apply_top_k_top_p(scaled, ks, ps), device,
                                                   args.reps)
                kept_torch = torch.isfinite(apply_top_k_top_p(scaled, ks, ps))
                row["sample_on_device_torch_ms"] = median_ms(
                    lambda params=params: sample_on_device(logits, params, [TokenUniforms(i) for i in range(b)],
                                                           TokenUniforms(0)), device, args.reps)
            finally:
                del os.environ[DISABLE_TRITON_SAMPLER_ENV]
            probs = target_probs(logits, params)
            uniforms = [TokenUniforms(i).random() for i in range(b)]
            row["draw_triton_ms"] = median_ms(lambda probs=probs, uniforms=uniforms: draw_tokens(probs, uniforms),
                                              device, args.reps)
            u = torch.tensor(uniforms, dtype=torch.float64, device=device)
            row["draw_torch_ms"] = median_ms(lambda probs=probs, u=u: draw_tokens_reference(probs, u), device,
                                             args.reps)
            kept = torch.isfinite(apply_top_k_top_p(scaled, ks, ps))
            row["filter_tokens_differing"] = int((kept != kept_torch).sum())
            row["draws_equal"] = draw_tokens(probs, uniforms).tolist() == draw_tokens_reference(probs, u).tolist()
        rows.append({k: round(x, 3) if isinstance(x, float) else x for k, x in row.items()})
        print(rows[-1], flush=True)
    if args.profile:
        out_profile = profile_sample(logits, device, b)
    out = {"command": " ".join(["python", *sys.argv]), "machine": platform.platform(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "threads": torch.get_num_threads(), "rows": args.rows, "vocab": args.vocab, "results": rows}
    if args.profile:
        out["profile_top_p_0.95"] = out_profile
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
