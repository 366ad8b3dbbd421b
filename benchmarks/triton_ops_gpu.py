"""GPU elementwise ops: TritonOps (one Triton kernel per op) vs TorchOps (the torch reference), bf16.

For the SmolLM2-135M shape (hidden 576, FFN 1536, 9 + 3 heads of 64) and the Llama-3.1-8B shape (hidden 4096,
FFN 14336, 32 + 8 heads of 128), at 1 / 8 / 64 tokens (decode batches) and 2048 (a prefill chunk), each op on
tensors laid out as the model has them (RoPE on the q|k view inside the fused qkv output):

- correctness, for bf16 and fp32: the largest distance in ulps of TritonOps' output from TorchOps'; the residual
  update of fused_add_rms_norm and RoPE must be bitwise torch's, the bf16 norms and silu_and_mul within
  ``BF16_ULPS`` (the script exits non-zero otherwise; fp32 distances are reported, not checked), and a CUDA-graph
  replay of the four TritonOps ops must equal their eager run bit for bit;
- GPU kernels per call (torch.profiler), and microseconds per call replayed from a CUDA graph of ``--calls``
  back-to-back calls (what a CUDA-graph decode step pays: no Python, no launch overhead) and eager (CUDA
  events around ``--iters`` calls: what a prefill step pays, Python and launch overhead included);
- ``layer``: one decoder layer's glue (fused_add_rms_norm, rope_, fused_add_rms_norm, silu_and_mul) at decode.

    python benchmarks/triton_ops_gpu.py                     # JSON to $OUT/triton_ops_gpu.json if $OUT is set,
    python benchmarks/triton_ops_gpu.py --out results.json  # else benchmarks/results/triton_ops_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.layers.ops import TorchOps  # noqa: E402
from specserve.layers.rope import RotaryEmbedding  # noqa: E402
from specserve.layers.triton_ops import TritonOps  # noqa: E402

SHAPES = {  # hidden, intermediate, num_heads, num_kv_heads, head_dim
    "smollm2": (576, 1536, 9, 3, 64),
    "llama8b": (4096, 14336, 32, 8, 128),
}
TOKENS = [1, 8, 64, 2048]
DEVICE = torch.device("cuda")
BF16_ULPS = 2
EPS = 1e-5


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    int_dtype, magnitude = {4: (torch.int32, 0x7FFFFFFF), 2: (torch.int16, 0x7FFF)}[t.element_size()]
    bits = t.contiguous().view(int_dtype).long()
    return torch.where(bits < 0, -(bits & magnitude), bits)


def max_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((ordered_bits(a) - ordered_bits(b)).abs().max().item()) if a.numel() else 0


class Inputs:
    """One layer's tensors for ``num_tokens`` tokens, and fresh copies of the ones the ops update in place."""

    def __init__(self, shape: str, num_tokens: int, dtype: torch.dtype, gen: torch.Generator) -> None:
        hidden, inter, heads, kv_heads, d = SHAPES[shape]
        dev = DEVICE

        def randn(*size, scale=1.0):
            return (torch.randn(*size, generator=gen, device=dev) * scale).to(dtype)

        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d
        self.x = randn(num_tokens, hidden, scale=3.0)
        self.residual = randn(num_tokens, hidden, scale=5.0)
        self.weight = randn(hidden)
        self.gate_up = randn(num_tokens, 2 * inter, scale=3.0)
        self.qkv = randn(num_tokens, (heads + 2 * kv_heads) * d, scale=2.0)
        rope = RotaryEmbedding(d, 8192, 500000.0, None, dev, dtype)
        positions = torch.randint(0, 8192, (num_tokens,), generator=gen, device=dev)
        self.cos, self.sin = rope.cos_sin(positions, dtype)

    def qk(self, qkv: torch.Tensor) -> torch.Tensor:
        n, d = qkv.shape[0], self.head_dim
        return qkv[:, :(self.heads + self.kv_heads) * d].view(n, self.heads + self.kv_heads, d)


def op_calls(ops: TorchOps, inp: Inputs) -> dict:
    """name -> a call of that op on ``inp`` (in-place ops update inp's own tensors)."""
    return {
        "rms_norm": lambda: ops.rms_norm(inp.x, inp.weight, EPS),
        "fused_add_rms_norm": lambda: ops.fused_add_rms_norm(inp.x, inp.residual, inp.weight, EPS),
        "rope_": lambda: ops.rope_(inp.qk(inp.qkv), inp.cos, inp.sin),
        "silu_and_mul": lambda: ops.silu_and_mul(inp.gate_up),
        "layer": lambda: (ops.fused_add_rms_norm(inp.x, inp.residual, inp.weight, EPS),
                          ops.rope_(inp.qk(inp.qkv), inp.cos, inp.sin),
                          ops.fused_add_rms_norm(inp.x, inp.residual, inp.weight, EPS),
                          ops.silu_and_mul(inp.gate_up)),
    }


def check(shape: str, num_tokens: int, dtype: torch.dtype, failures: list[str]) -> dict:
    """Ulp distances of TritonOps from TorchOps on identical inputs; bitwise checks for residual and rope."""
    name = f"{shape} n={num_tokens} {str(dtype).removeprefix('torch.')}"
    ref = Inputs(shape, num_tokens, dtype, torch.Generator(device=DEVICE).manual_seed(0))
    new = Inputs(shape, num_tokens, dtype, torch.Generator(device=DEVICE).manual_seed(0))
    t_ops, r_ops = TritonOps(), TorchOps()
    row = {
        "rms_norm_ulps": max_ulps(t_ops.rms_norm(new.x, new.weight, EPS), r_ops.rms_norm(ref.x, ref.weight, EPS)),
        "fused_add_rms_norm_ulps": max_ulps(t_ops.fused_add_rms_norm(new.x, new.residual, new.weight, EPS),
                                            r_ops.fused_add_rms_norm(ref.x, ref.residual, ref.weight, EPS)),
        "residual_bitwise": torch.equal(new.residual, ref.residual),
        "silu_and_mul_ulps": max_ulps(t_ops.silu_and_mul(new.gate_up), r_ops.silu_and_mul(ref.gate_up)),
    }
    t_ops.rope_(new.qk(new.qkv), new.cos, new.sin)
    r_ops.rope_(ref.qk(ref.qkv), ref.cos, ref.sin)
    row["rope_bitwise"] = torch.equal(new.qkv, ref.qkv)
    row["rope_ulps"] = max_ulps(new.qkv, ref.qkv)
    for key in ("residual_bitwise", "rope_bitwise"):
        if not row[key]:
            failures.append(f"{name}: {key} is False")
    if dtype == torch.bfloat16:
        for key in ("rms_norm_ulps", "fused_add_rms_norm_ulps", "silu_and_mul_ulps"):
            if row[key] > BF16_ULPS:
                failures.append(f"{name}: {key} = {row[key]} > {BF16_ULPS}")
    return row


def check_graph(shape: str, num_tokens: int, failures: list[str]) -> None:
    """A CUDA graph of the four TritonOps ops replays to their eager results, bit for bit."""
    eager = Inputs(shape, num_tokens, torch.bfloat16, torch.Generator(device=DEVICE).manual_seed(1))
    graphed = Inputs(shape, num_tokens, torch.bfloat16, torch.Generator(device=DEVICE).manual_seed(1))
    ops = TritonOps()
    want = op_calls(ops, eager)["layer"]()
    start = (graphed.residual.clone(), graphed.qkv.clone())
    op_calls(ops, graphed)["layer"]()  # compiled already; warm the allocator
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = op_calls(ops, graphed)["layer"]()
    graphed.residual.copy_(start[0])
    graphed.qkv.copy_(start[1])
    graph.replay()
    torch.cuda.synchronize()
    outs = (got[0], got[2], got[3], graphed.residual, graphed.qkv)
    wants = (want[0], want[2], want[3], eager.residual, eager.qkv)
    if not all(torch.equal(a, b) for a, b in zip(outs, wants)):
        failures.append(f"{shape} n={num_tokens}: CUDA-graph replay != eager")


def kernels_per_call(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def graph_us(fn, calls: int, replays: int) -> float:
    """Microseconds per call of ``fn`` replayed from one CUDA graph of ``calls`` back-to-back calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def eager_us(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--calls", type=int, default=50, help="back-to-back calls captured in one graph")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--iters", type=int, default=200, help="eager calls timed")
    args = ap.parse_args()
    import triton
    out_path = args.out or (Path(os.environ["OUT"]) / "triton_ops_gpu.json" if os.environ.get("OUT") else
                            Path(__file__).resolve().parent / "results" / "triton_ops_gpu.json")
    failures: list[str] = []
    checks, rows = [], []
    for shape in SHAPES:
        for n in TOKENS:
            for dtype in (torch.bfloat16, torch.float32):
                row = check(shape, n, dtype, failures)
                checks.append({"shape": shape, "num_tokens": n, "dtype": str(dtype), **row})
                print(checks[-1], flush=True)
            check_graph(shape, n, failures)
    print(f"\n{'shape':>8} {'n':>5} {'op':>19} | {'kernels':>7} | {'graph us torch':>14} {'triton':>7} {'x':>6} | "
          f"{'eager us torch':>14} {'triton':>7}")
    for shape in SHAPES:
        for n in TOKENS:
            inp = Inputs(shape, n, torch.bfloat16, torch.Generator(device=DEVICE).manual_seed(2))
            torch_calls, triton_calls = op_calls(TorchOps(), inp), op_calls(TritonOps(), inp)
            for op in torch_calls:
                row = {"shape": shape, "num_tokens": n, "op": op,
                       "kernels_torch": kernels_per_call(torch_calls[op]),
                       "kernels_triton": kernels_per_call(triton_calls[op]),
                       "graph_us_torch": graph_us(torch_calls[op], args.calls, args.replays),
                       "graph_us_triton": graph_us(triton_calls[op], args.calls, args.replays),
                       "eager_us_torch": eager_us(torch_calls[op], args.iters),
                       "eager_us_triton": eager_us(triton_calls[op], args.iters)}
                row["graph_speedup"] = row["graph_us_torch"] / row["graph_us_triton"]
                rows.append(row)
                print(f"{shape:>8} {n:>5} {op:>19} | {row['kernels_torch']:>3}->{row['kernels_triton']:<3} | "
                      f"{row['graph_us_torch']:>14.2f} {row['graph_us_triton']:>7.2f} {row['graph_speedup']:>5.2f}x | "
                      f"{row['eager_us_torch']:>14.2f} {row['eager_us_triton']:>7.2f}", flush=True)
            del inp
            torch.cuda.empty_cache()
    result = {
        "command": " ".join(["python", *sys.argv]), "git_commit": git_commit(),
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": triton.__version__, "python": platform.python_version(), "dtype": "bfloat16",
        "calls_per_graph": args.calls, "replays": args.replays, "eager_iters": args.iters,
        "failures": failures, "checks": checks, "results": rows,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out_path}")
    if failures:
        print(f"\n{len(failures)} FAILURE(S):", file=sys.stderr)
        for f in failures:
            print("  " + f, file=sys.stderr)
        return 1
    print("all checks pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
