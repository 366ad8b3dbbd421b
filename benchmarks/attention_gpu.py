"""GPU attention over the paged KV cache: TritonAttentionBackend vs TorchAttentionBackend (the reference).

One layer of attention at decode / verify (every sequence has ``query_len`` new tokens after ``context`` cached
ones), bf16, block_size 16, each sequence owning shuffled non-contiguous cache blocks, for two shapes:

    llama8b: Llama-3.1-8B, 32 query heads, 8 KV heads, head_dim 128
    smollm2: SmolLM2-135M,  9 query heads, 3 KV heads, head_dim 64

at batch 1 / 8 / 32 / 64, context 512 / 2048, query_len 1 / 2 / 4 / 8 (decode; verify of 1 / 3 / 7 drafts).

Correctness first, for every configuration, and the script exits non-zero on any failure:
- bf16: max |out - ref32| of the Triton and of the torch backend, where ref32 is the torch backend in fp32 on
  the same (bf16-rounded) inputs; the Triton error must stay under ``BF16_ATOL``;
- fp32: the Triton backend (tl.dot in IEEE fp32) vs the torch backend in fp32, under ``FP32_ATOL``;
- the caches both backends wrote are bit-identical;
- a CUDA graph of the Triton forward (fixed num_splits) replays to the eager output, bit for bit.

Timing: ``forward`` alone (it writes the step's K/V, then attends; ``prepare`` runs once per step for all layers
and is excluded), CUDA events around ``--iters`` back-to-back calls after ``--warmup`` calls, mean per call.
``triton graph`` replays the captured forward (no Python or launch overhead: what a CUDA-graph decode step
pays). ``splits`` is the split-KV count the auto heuristic chose; where it is > 1, ``triton 1-split`` times the
same kernels without splitting.

    python benchmarks/attention_gpu.py                      # JSON to $OUT/attention_gpu.json if $OUT is set,
    python benchmarks/attention_gpu.py --out results.json   # else benchmarks/results/attention_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.layers.attention import TorchAttentionBackend, build_attention_metadata  # noqa: E402

SHAPES = {  # name -> (num_heads, num_kv_heads, head_dim)
    "llama8b": (32, 8, 128),
    "smollm2": (9, 3, 64),
}
BLOCK_SIZE = 16
DEVICE = torch.device("cuda")
BF16_ATOL = 2e-2  # outputs are O(1) averages of N(0, 1) values; bf16 rounding of the output alone is ~4e-3
FP32_ATOL = 1e-4


def make_batch(num_heads: int, num_kv_heads: int, head_dim: int, batch: int, context: int, query_len: int,
               gen: torch.Generator, device: torch.device):
    """fp32 inputs on ``device`` (``gen`` lives there): a decode/verify batch whose sequences own shuffled,
    non-contiguous blocks."""
    seq_len = context + query_len
    blocks_per_seq = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 1
    ids = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    tables = [ids[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
    meta = build_attention_metadata([query_len] * batch, [seq_len] * batch, tables, BLOCK_SIZE, device)
    n = meta.num_tokens
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device)
    v_cache = torch.randn(shape, generator=gen, device=device)
    # q/k/v as the model passes them: views into one fused qkv projection output
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen, device=device)
    return meta, qkv, k_cache, v_cache


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    n = qkv.shape[0]
    q = qkv[:, :num_heads * head_dim].view(n, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(n, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(n, num_kv_heads, head_dim)
    return q, k, v


def own_meta(meta):
    """A copy of the step's metadata for one backend: prepare() stores that backend's indices in ``extra``."""
    return replace(meta, extra=None)


def run(backend, meta, q, k, v, k_cache, v_cache):
    """(out, k_cache, v_cache) of one prepare + forward on fresh copies of the caches."""
    kc, vc = k_cache.clone(), v_cache.clone()
    meta = own_meta(meta)
    backend.prepare(meta, BLOCK_SIZE)
    return backend.forward(q, k, v, kc, vc, meta), kc, vc


def time_forward(fn, warmup: int, iters: int) -> float:
    """Mean microseconds per call of ``fn`` over ``iters`` back-to-back calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def capture_graph(backend, meta, q, k, v, k_cache, v_cache):
    """A CUDA graph of ``backend.forward`` (prepare already ran) and its static output tensor."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm the allocator outside the capture
        for _ in range(3):
            backend.forward(q, k, v, k_cache, v_cache, meta)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, k_cache, v_cache, meta)
    return graph, out


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "attention_gpu.json"
    return Path(__file__).resolve().parent / "results" / "attention_gpu.json"


def bench_config(shape: str, batch: int, context: int, query_len: int, args, gen) -> tuple[dict, list[str]]:
    from specserve.layers.triton_attention import TritonAttentionBackend

    device = DEVICE
    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    meta, qkv32, k_cache32, v_cache32 = make_batch(num_heads, num_kv_heads, head_dim, batch, context, query_len,
                                                   gen, device)
    failures: list[str] = []
    name = f"{shape} batch={batch} context={context} query_len={query_len}"

    # bf16 inputs, and fp32 copies of exactly those values for the fp32 reference
    qkv, k_cache, v_cache = qkv32.bfloat16(), k_cache32.bfloat16(), v_cache32.bfloat16()
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q32, k32, v32 = split_qkv(qkv.float(), num_heads, num_kv_heads, head_dim)
    torch_backend = TorchAttentionBackend()
    def triton(num_splits: int | None) -> TritonAttentionBackend:
        return TritonAttentionBackend(num_splits=num_splits, block_n=args.block_n, decode_warps=args.decode_warps,
                                      decode_block_n=args.decode_block_n)
    triton_backend = triton(args.num_splits)
    ref32, _, _ = run(torch_backend, meta, q32, k32, v32, k_cache.float(), v_cache.float())
    ref_bf16, ref_k, ref_v = run(torch_backend, meta, q, k, v, k_cache, v_cache)
    out_bf16, out_k, out_v = run(triton_backend, meta, q, k, v, k_cache, v_cache)
    err_torch = (ref_bf16.float() - ref32).abs().max().item()
    err_triton = (out_bf16.float() - ref32).abs().max().item()
    if not (err_triton <= BF16_ATOL):  # also catches NaN
        failures.append(f"{name}: bf16 triton max|err| {err_triton:.3g} > {BF16_ATOL} (torch bf16: {err_torch:.3g})")
    if not (torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)):
        failures.append(f"{name}: the Triton backend wrote different K/V into the cache than the reference")
    out32, _, _ = run(triton_backend, meta, q32, k32, v32, k_cache.float(), v_cache.float())
    err_fp32 = (out32 - ref32).abs().max().item()
    if not (err_fp32 <= FP32_ATOL):
        failures.append(f"{name}: fp32 triton max|err| {err_fp32:.3g} > {FP32_ATOL}")
    del ref32, out32, q32, k32, v32

    triton_meta = own_meta(meta)
    triton_backend.prepare(triton_meta, BLOCK_SIZE)
    splits = triton_backend.decode_splits(triton_meta, num_kv_heads, device)
    row = {"shape": shape, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
           "batch": batch, "context": context, "query_len": query_len, "splits": splits,
           "max_abs_err_bf16": {"triton": err_triton, "torch": err_torch}, "max_abs_err_fp32_triton": err_fp32}

    kc, vc = k_cache.clone(), v_cache.clone()  # repeated forwards rewrite the same slots with the same values
    torch_meta = own_meta(meta)
    torch_backend.prepare(torch_meta, BLOCK_SIZE)
    row["torch_us"] = time_forward(lambda: torch_backend.forward(q, k, v, kc, vc, torch_meta), args.warmup,
                                   args.iters)
    row["triton_us"] = time_forward(lambda: triton_backend.forward(q, k, v, kc, vc, triton_meta), args.warmup,
                                    args.iters)
    if splits > 1:
        one_split = triton(1)
        out_one, _, _ = run(one_split, meta, q, k, v, k_cache, v_cache)
        err_one = (out_one.float() - out_bf16.float()).abs().max().item()
        if not (err_one <= BF16_ATOL):
            failures.append(f"{name}: 1-split vs {splits}-split outputs differ by {err_one:.3g}")
        one_meta = own_meta(meta)
        one_split.prepare(one_meta, BLOCK_SIZE)
        row["triton_1split_us"] = time_forward(lambda: one_split.forward(q, k, v, kc, vc, one_meta), args.warmup,
                                               args.iters)

    if not args.no_graph:
        fixed = triton(splits)  # a captured step keeps its grid
        graph_meta = own_meta(meta)
        fixed.prepare(graph_meta, BLOCK_SIZE)
        try:
            graph, graph_out = capture_graph(fixed, graph_meta, q, k, v, kc, vc)
            graph.replay()
            eager = fixed.forward(q, k, v, kc, vc, graph_meta)
            torch.cuda.synchronize()
            if not torch.equal(graph_out, eager):
                failures.append(f"{name}: CUDA-graph replay != eager forward "
                                f"(max diff {(graph_out.float() - eager.float()).abs().max().item():.3g})")
            row["triton_graph_us"] = time_forward(graph.replay, args.warmup, args.iters)
            del graph
        except Exception as exc:  # recorded as a failure; the run goes on
            failures.append(f"{name}: CUDA-graph capture of the Triton forward failed: {exc!r}")
            row["triton_graph_error"] = repr(exc)
    row["speedup"] = row["torch_us"] / row["triton_us"]
    return row, failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: $OUT/attention_gpu.json or "
                                                           "benchmarks/results/attention_gpu.json)")
    ap.add_argument("--shapes", default="llama8b,smollm2")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--query-lens", default="1,2,4,8")
    ap.add_argument("--num-splits", type=int, default=None, help="fixed split-KV count (default: auto per step)")
    ap.add_argument("--block-n", type=int, default=64, help="keys per tile of the Triton kernels")
    ap.add_argument("--decode-block-n", type=int, default=None, help="keys per decode tile (default: by head size)")
    ap.add_argument("--decode-warps", type=int, default=None, help="warps per decode program (default: by tile)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph capture and replay")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("attention_gpu.py needs a CUDA device", file=sys.stderr)
        return 1
    import triton

    out_path = args.out or default_out()
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"--shapes: unknown shape {s!r} (choose from {', '.join(SHAPES)})")
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    configs = [(s, b, c, ql) for s in shapes for b in ints(args.batches) for c in ints(args.contexts)
               for ql in ints(args.query_lens)]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows, failures = [], []
    print(f"paged attention, one layer, bf16, block {BLOCK_SIZE}; forward us (CUDA events, mean of {args.iters}); "
          f"errors are max |out - fp32 reference|")
    header = (f"{'shape':>8} {'batch':>5} {'ctx':>5} {'q':>2} | {'torch':>8} {'triton':>8} {'graph':>8} "
              f"{'1-split':>8} {'splits':>6} {'speedup':>7} | {'err triton':>10} {'err torch':>9}")
    print(header)
    print("-" * len(header))
    with torch.inference_mode():
        for shape, batch, context, query_len in configs:
            row, fails = bench_config(shape, batch, context, query_len, args, gen)
            rows.append(row)
            failures += fails
            us = {key: f"{row[key]:8.1f}" if key in row else f"{'-':>8}"
                  for key in ("torch_us", "triton_us", "triton_graph_us", "triton_1split_us")}
            print(f"{shape:>8} {batch:>5} {context:>5} {query_len:>2} | {us['torch_us']} {us['triton_us']} "
                  f"{us['triton_graph_us']} {us['triton_1split_us']} {row['splits']:>6} {row['speedup']:>6.2f}x | "
                  f"{row['max_abs_err_bf16']['triton']:>10.2e} {row['max_abs_err_bf16']['torch']:>9.2e}"
                  + ("  FAIL" if fails else ""), flush=True)
            torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    result = {
        "command": " ".join(["python", *sys.argv]),
        "git_commit": git_commit(),
        "gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
        "num_sms": props.multi_processor_count,
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
        "python": platform.python_version(),
        "block_size": BLOCK_SIZE, "dtype": "bfloat16", "warmup": args.warmup, "iters": args.iters,
        "num_splits": args.num_splits if args.num_splits is not None else "auto",
        "tolerances": {"bf16": BF16_ATOL, "fp32": FP32_ATOL},
        "failures": failures, "results": rows,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out_path}")
    if failures:
        print(f"\n{len(failures)} FAILURE(S):", file=sys.stderr)
        for f in failures:
            print("  " + f, file=sys.stderr)
        return 1
    print("all outputs match the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
