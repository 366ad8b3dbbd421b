"""CPU decode attention: the C++ paged backend (specserve/kernels/cpu_paged_attention.cpp) vs TorchAttentionBackend.

One layer of SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64, block_size 16) at decode (one new
token per sequence) for batch 1 / 8 / 32 and context 128 / 512 / 2048. Each sequence owns shuffled, non-contiguous
cache blocks. A timed call is ``prepare(meta) + forward(...)`` (forward writes the step's K/V into the cache, then
attends); prepare runs once per step in the engine, so "fwd" (forward alone) is also reported: a 30-layer step
costs about prepare + 30 * fwd. The cache of one layer is reused across calls, so small shapes run from L3
(real steps stream 30 layers' caches), which flatters both backends equally.

Reports the median of individually timed calls (the machine is shared; the mean is in the JSON) over --rounds
interleaved rounds, keeping each configuration's best round median.

    .venv/bin/python benchmarks/cpu_attention.py [--threads 2] [--rounds 3]
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

from specserve.bench.machine import machine_info as machine  # noqa: E402
from specserve.layers.attention import TorchAttentionBackend, build_attention_metadata  # noqa: E402
from specserve.layers.cpu_attention import CpuPagedAttentionBackend, load_attention_extension  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
BATCHES = [1, 8, 32]
SEQ_LENS = [128, 512, 2048]


def decode_batch(batch: int, seq_len: int, gen: torch.Generator):
    blocks_per_seq = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 1
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [ids[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
    meta = build_attention_metadata([1] * batch, [seq_len] * batch, tables, BLOCK_SIZE, torch.device("cpu"))
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    return meta, q, k, v, k_cache, v_cache


def time_calls(fn, min_calls: int, min_seconds: float) -> tuple[float, float]:
    """(median, mean) seconds of one call; each call timed on its own."""
    fn()  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), statistics.fmean(times)


def measure(backend, meta, q, k, v, k_cache, v_cache, min_seconds: float) -> dict:
    def step():
        backend.prepare(meta, BLOCK_SIZE)
        backend.forward(q, k, v, k_cache, v_cache, meta)

    backend.prepare(meta, BLOCK_SIZE)

    def fwd():
        backend.forward(q, k, v, k_cache, v_cache, meta)

    step_med, step_mean = time_calls(step, 5, min_seconds)
    fwd_med, _ = time_calls(fwd, 5, min_seconds)
    return {"step_us": step_med * 1e6, "step_mean_us": step_mean * 1e6, "fwd_us": fwd_med * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=0.2, help="per configuration, backend and round")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cpu_attention.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = load_attention_extension()
    if ext is None:
        print("the CPU paged-attention extension could not be built", file=sys.stderr)
        return 1
    backends = {"torch": TorchAttentionBackend(), "paged": CpuPagedAttentionBackend(ext)}
    gen = torch.Generator().manual_seed(0)
    configs = [(b, s) for b in BATCHES for s in SEQ_LENS]
    data = {c: decode_batch(*c, gen) for c in configs}
    for c in configs:  # the two backends agree on every benchmarked shape
        meta, q, k, v, kc, vc = data[c]
        outs = []
        for backend in backends.values():
            backend.prepare(meta, BLOCK_SIZE)
            outs.append(backend.forward(q, k, v, kc, vc, meta))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)
    best: dict = {}
    for _ in range(args.rounds):
        for c in configs:
            for name, backend in backends.items():
                r = measure(backend, *data[c], min_seconds=args.min_seconds)
                prev = best.get((c, name))
                if prev is None or r["step_us"] < prev["step_us"]:
                    best[(c, name)] = r
    rows = []
    print(f"decode attention, one layer, H={NUM_HEADS} KVH={NUM_KV_HEADS} D={HEAD_DIM} block={BLOCK_SIZE}, "
          f"{args.threads} threads (median us; step = prepare + forward, fwd = forward alone)")
    print(f"{'batch':>5} {'seq_len':>7} | {'torch step':>10} {'torch fwd':>9} | {'paged step':>10} {'paged fwd':>9} "
          f"| {'speedup step':>12} {'speedup fwd':>11}")
    for batch, seq_len in configs:
        t, p = best[((batch, seq_len), "torch")], best[((batch, seq_len), "paged")]
        row = {"batch": batch, "seq_len": seq_len, "torch": t, "paged": p,
               "speedup_step": t["step_us"] / p["step_us"], "speedup_fwd": t["fwd_us"] / p["fwd_us"]}
        rows.append(row)
        print(f"{batch:>5} {seq_len:>7} | {t['step_us']:>10.1f} {t['fwd_us']:>9.1f} | {p['step_us']:>10.1f} "
              f"{p['fwd_us']:>9.1f} | {row['speedup_step']:>11.2f}x {row['speedup_fwd']:>10.2f}x")
    result = {"command": "python " + " ".join(sys.argv), "machine": machine(), "kernel_avx2": ext.built_with_avx2(),
              "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                        "block_size": BLOCK_SIZE}, "rounds": args.rounds, "results": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
