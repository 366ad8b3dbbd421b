"""Cost of verifying sampled requests with one-hot drafts: the position-coupled form (``spec/verify.py``,
every drafted row drawn, one read) against the chain it replaced for them (``_verify_chain`` with one-hot
drafts: p(x) gathered and read, then the final rows drawn, two reads), on the same synthetic logits.
Median milliseconds per ``verify`` call per batch size; writes ``--out`` (JSON) with the command and the machine.

    python benchmarks/verify_cost.py --device cpu --out benchmarks/results/verify_cost_cpu.json
    python benchmarks/verify_cost.py --device cuda --out $OUT/verify_cost_gpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.layers.sampler import TokenUniforms, target_probs  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.spec.verify import _offsets, _verify_chain, _verify_sampled  # noqa: E402


def case(batch: int, k: int, vocab: int, device: torch.device, seed: int = 0):
    """Target probabilities of ``batch`` sampled requests with ``k`` one-hot drafts each, the drafts being the
    rows' argmaxes half the time (so that runs of accepted drafts and rejections both occur)."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch * (k + 1), vocab, generator=gen) * 3).to(device)
    params = [SamplingParams(temperature=0.8, top_p=0.95)] * (batch * (k + 1))
    probs = target_probs(logits, params)
    top = logits.argmax(dim=-1).tolist()
    starts = _offsets([k + 1] * batch)
    drafts = [[top[s + j] if torch.rand((), generator=gen) < 0.5 else int(torch.randint(vocab, (), generator=gen))
               for j in range(k)] for s in starts]
    return probs, drafts


def time_verify(fn, probs: torch.Tensor, drafts: list[list[int]], reps: int) -> float:
    """Median seconds of ``fn(probs, drafts, one-hot, fresh streams)``, which reads its result back to the host
    as the engine does."""
    times = []
    for _ in range(reps + 2):
        streams = [TokenUniforms(i) for i in range(len(drafts))]
        if probs.is_cuda:
            torch.cuda.synchronize(probs.device)
        t0 = time.perf_counter()
        fn(probs, drafts, [None] * len(drafts), streams)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--vocabs", default="49152,128256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for vocab in map(int, args.vocabs.split(",")):
        for batch in map(int, args.batches.split(",")):
            probs, drafts = case(batch, args.k, vocab, device)
            coupled = time_verify(_verify_sampled, probs, drafts, args.reps)
            chain = time_verify(_verify_chain, probs, drafts, args.reps)
            rows.append({"vocab": vocab, "batch": batch, "k": args.k, "coupled_ms": round(coupled * 1e3, 3),
                         "chain_ms": round(chain * 1e3, 3), "coupled_vs_chain": round(coupled / chain, 3)})
            print(rows[-1])
    out = {"command": " ".join(["python", *sys.argv]), "machine": platform.platform(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "threads": torch.get_num_threads(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
