"""The LM head's GEMM, and the decoder layer's projections, on the GPU (issue 6's verify bar; GPU machine, not
CI). fp32 logits of ``rows`` bf16 hidden states against a [vocab, hidden] bf16 weight, side by side in one run,
CUDA events over many calls:

- ``mm_out_fp32``: ``torch.mm(x, w.t(), out_dtype=float32)`` (what ``dense_linear(float_out=True)`` runs);
- ``linear_then_float``: ``F.linear`` in bf16, then ``.float()``;
- ``mm_wt_out_fp32``: ``torch.mm(w, x.t(), out_dtype=float32).t()`` (the transposed product; a strided view);
- ``linear_bf16``: ``F.linear`` in bf16 alone (a lower bound: no fp32 logits).

``--projections``: the Llama-3.1-8B layer's bf16 projections (qkv, o, gate_up, down) the same way, ``F.linear``
against the transposed product ``torch.mm(w, x.t()).t()``, as a view and made contiguous (cuBLAS picks other
kernels for the two layouts).

    python benchmarks/lm_head_gpu.py --rows 32,256 --out $OUT/lm_head.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.attention_gpu import time_forward  # noqa: E402

PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def compare(methods: dict, flop: int, iters: int, label: str) -> dict:
    """Each method timed; its largest difference from the first method's result."""
    ref = next(iter(methods.values()))().float()
    row = {}
    for name, fn in methods.items():
        ms = time_forward(fn, 5, iters) / 1e3
        err = (fn().float() - ref).abs().max().item()
        row[name] = {"ms": ms, "tflop_s": flop / ms / 1e9, "max_abs_diff": err}
        print(f"{label} {name:18s} {ms * 1e3:8.1f} us  {row[name]['tflop_s']:6.0f} TFLOP/s  diff {err:.2e}")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--projections", action="store_true", help="also the Llama-3.1-8B layer's projections")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "lm_head.json"))
    args = ap.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(args.vocab, args.hidden, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
    out = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
           "vocab": args.vocab, "hidden": args.hidden, "by_rows": {}}
    for m in map(int, args.rows.split(",")):
        x = torch.randn(m, args.hidden, device=device, generator=gen, dtype=torch.bfloat16)
        methods = {"mm_out_fp32": lambda x=x: torch.mm(x, w.t(), out_dtype=torch.float32),
                   "linear_then_float": lambda x=x: F.linear(x, w).float(),
                   "mm_wt_out_fp32": lambda x=x: torch.mm(w, x.t(), out_dtype=torch.float32).t(),
                   "linear_bf16": lambda x=x: F.linear(x, w)}
        out["by_rows"][str(m)] = compare(methods, 2 * m * args.hidden * args.vocab, args.iters, f"head rows {m:4d}")
    if args.projections:
        out["projections"] = {}
        for pname, (n, k) in PROJECTIONS.items():
            wp = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
                methods = {"linear": lambda x=x, wp=wp: F.linear(x, wp),
                           "mm_wt_view": lambda x=x, wp=wp: torch.mm(wp, x.t()).t(),
                           "mm_wt_contiguous": lambda x=x, wp=wp: torch.mm(wp, x.t()).t().contiguous()}
                out["projections"][f"{pname}_{m}"] = compare(methods, 2 * m * n * k, args.iters,
                                                             f"{pname:7s} rows {m:4d}")
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
