"""Greedy tokens on the GPU: ``logits.argmax(dim=-1)`` against ``layers/argmax.greedy_argmax`` (the row read in
slices), fp32 logits as the engine samples them, Llama-3 (128256) and SmolLM2 (49152) vocabularies, 1 to 256
rows. GPU machine, not CI.

    python benchmarks/argmax_gpu.py --out $OUT/argmax_gpu.json

Per case: microseconds per call replayed from a CUDA graph of ``--calls`` back-to-back calls of each form (what
a graph pays; eager adds the same launches' host time), their ratio, and equality with ``argmax`` on random
rows, on rows with the maximum tied across slices, and on rows with NaN. Exits non-zero on any disagreement.
Where the rule keeps one launch for a few rows (SmolLM2's 49152: under ``SPLIT_MIN_VOCAB``), the split form is
timed and checked too (``forced_chunks``, ``forced_us``), so one run can confirm or move the threshold.
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

from benchmarks.gpu_engine import graph_time_s  # noqa: E402
from specserve.layers.argmax import SPLIT_MAX_ROWS, dividing_chunks, greedy_argmax, split_chunks  # noqa: E402

VOCABS = {"llama3": 128256, "smollm2": 49152}
ROWS = [1, 8, 32, 64, 256]


def cases(rows: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Named [rows, vocab] fp32 logits: random, a maximum tied in two slices, NaN in some rows."""
    gen = torch.Generator(device=device).manual_seed(rows * 7 + vocab)
    rand = torch.randn(rows, vocab, generator=gen, device=device)
    tied = rand.clone()
    tied[:, vocab - 3] = 100.0
    tied[:, 5 + rows % 7] = 100.0
    nan = rand.clone()
    nan[::2, vocab // 2] = float("nan")
    nan[::3, vocab // 3 + 1] = float("nan")
    return {"random": rand, "tied": tied, "nan": nan}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "argmax_gpu.json"))
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    t0 = time.perf_counter()
    rep: dict = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                 "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "cases": {}, "errors": []}
    for vname, vocab in VOCABS.items():
        for rows in ROWS:
            key = f"{vname}_r{rows}"
            data = cases(rows, vocab, device)
            chunks = split_chunks(rows, vocab)
            # where the rule keeps one launch (SPLIT_MIN_VOCAB), the split form is checked and timed anyway
            forced = dividing_chunks(vocab) if chunks == 1 and rows <= SPLIT_MAX_ROWS else 1
            for form in (None, forced) if forced > 1 else (None,):
                for name, logits in data.items():
                    if not torch.equal(greedy_argmax(logits, form), logits.argmax(dim=-1)):
                        rep["errors"].append(f"{key} {name}: greedy_argmax(chunks={form}) != argmax")
            x = data["random"]
            torch_us = graph_time_s(lambda x=x: [x.argmax(dim=-1) for _ in range(args.calls)]) / args.calls * 1e6
            ours_us = graph_time_s(lambda x=x: [greedy_argmax(x) for _ in range(args.calls)]) / args.calls * 1e6
            case = {"rows": rows, "vocab": vocab, "chunks": chunks, "argmax_us": torch_us,
                    "greedy_argmax_us": ours_us, "speedup": torch_us / ours_us}
            line = f"{key:>14} chunks {chunks:>3}: argmax {torch_us:7.2f} us  sliced {ours_us:7.2f} us  " \
                   f"x{torch_us / ours_us:.2f}"
            if forced > 1:
                forced_us = graph_time_s(
                    lambda x=x, c=forced: [greedy_argmax(x, c) for _ in range(args.calls)]) / args.calls * 1e6
                case.update(forced_chunks=forced, forced_us=forced_us, forced_speedup=torch_us / forced_us)
                line += f"  (forced {forced}: {forced_us:7.2f} us x{torch_us / forced_us:.2f})"
            rep["cases"][key] = case
            print(line, flush=True)
    rep["total_seconds"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rep, indent=1))
    for err in rep["errors"]:
        print("ERROR", err)
    return 1 if rep["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
