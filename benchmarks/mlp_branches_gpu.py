"""The Llama-3.1-8B MLP at verify row counts run as concurrent branches over slices of the intermediate dimension,
against the engine's one gate_up GEMM + SiLU-and-mul + one down GEMM, side by side in one run (GPU machine, not CI).

Why: at 256 rows (batch 32 x 8 query tokens) cuBLAS runs gate_up as 224 tiles of 256x128 on 132 SMs: 1.7 waves,
so 15% of the SMs idle through the second one (cuBLAS's other algorithms fill it no better,
``cublaslt_algos_gpu.py``; our own stream-K GEMMs lost per tile, ``triton_gemm_*gpu.json``). The MLP splits exactly
along its intermediate dimension: with gate_up's rows grouped per slice c (gate_c then up_c),
``down(silu(gate) * up) = sum_c down_c(silu(gate_c) * up_c)``, where down_c is down's column slice c. Each slice is
an independent branch (its own GEMMs and SiLU); on two CUDA streams inside one graph, a branch's SiLU and down
GEMM can start on the SMs that the other branch's gate_up tail leaves idle. The partial sums are fp32 (``torch.mm``
with ``out_dtype``), added in fp32 and rounded once: a split-K of down, no extra bf16 rounding.

Variants per row count (``--rows``), each timed as a CUDA graph of ``--reps`` passes over ``--copies`` layers'
weights (HBM-resident, as in a forward), median of 5 replays, per MLP:

- ``fused``: the engine's path (``F.linear`` -> ``TritonOps.silu_and_mul`` -> ``F.linear``);
- ``c{C}_s1``: C slices one after another on one stream (the price of slicing alone);
- ``c{C}_s{S}``: C slices, slice c on stream c mod S.

``max_abs_diff`` is each variant's output against ``fused`` (other summation orders, and down's split sums
rounded once: small, not zero).
``sum_us``: the fp32 sum of C partials and its rounding alone, included in the ``c{C}_*`` times; an engine would
fold it into the residual add that follows the MLP.

``--engine``: then the whole step, as issue 6's figure takes it: the Llama-3.1-8B target forward + LM head replayed
from the runner's CUDA graphs at batch 32 (dummy weights), decode (1 token) and verify (8 tokens), with every
layer's MLP as the engine has it (``fused``) and as ``c{C}_s{S}`` branches for steps of at least ``--min-rows`` rows
(``patch_branches``: the layers' ``mlp.forward`` replaced in this process only, sliced weight copies beside the
model's), settings alternated over ``--rounds``; ``verify8_vs_decode`` per setting, and the verify logits' distance.

    python benchmarks/mlp_branches_gpu.py --out $OUT/mlp_branches_gpu.json
    python benchmarks/mlp_branches_gpu.py --engine --rows 256 --slices 2 --streams 2 --out $OUT/mlp_branches_gpu.json
    python benchmarks/mlp_branches_gpu.py --device cpu --smoke   # the maths of every variant, eagerly, on CPU

Reading (stop 41, one H200 run, ``results/mlp_branches_h200.json``; taken at 47ab3b6, where ``--engine`` split the
engine's own MLPs in place, gate|up's rows interleaved per slice, rather than patching copies as here): the branches
lose at every row count. Per MLP at 256 rows: fused 143.4 us (629 TFLOP/s), c2_s2 150.4, c2_s1 160.1, c4_s2 169.9;
at 32 rows c2_s2 ties (94.0 vs 93.0 us). The fp32 sum of two partials alone costs 5.3 us (``sum_us``), more than
the second stream wins back. In the engine at batch 32 (same weights, branches on or off by step size): verify
7.907 -> 8.039 ms, decode 5.475 -> 5.464 ms, verify8_vs_decode 1.444 -> 1.471, logits equal bit for bit; a
gpu_engine.py run with the branches gave 1.460 (``gpu_engine_h200_mlp_branches.json``). Not adopted; the engine
code was reverted (c131d10).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.layers.ops import TorchOps  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402


class MlpWeights:
    """One layer's MLP weights in both layouts: ``gate_up`` [2 * inter, hidden] (gate rows, then up rows: the
    engine's) and per slice c of ``slices`` the rows ``[gate_c; up_c]`` as one contiguous [2 * inter / C, hidden]
    tensor, plus ``down`` [hidden, inter] and its column slices (strided views, no copy).

    Worked example (inter = 4, C = 2): gate rows g0..g3, up rows u0..u3; slice 0 holds [g0, g1, u0, u1], slice 1
    [g2, g3, u2, u3]; down's slice 0 is its columns 0-1, slice 1 columns 2-3."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, slices: tuple[int, ...]) -> None:
        # gate_up: [2 * inter, hidden]; down: [hidden, inter]
        self.gate_up, self.down = gate_up, down
        inter = down.shape[1]
        gate, up = gate_up[:inter], gate_up[inter:]
        self.sliced: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for c in slices:
            width = inter // c
            self.sliced[c] = [(torch.cat([gate[i * width:(i + 1) * width], up[i * width:(i + 1) * width]]),
                               down[:, i * width:(i + 1) * width]) for i in range(c)]


def mlp_fused(
    ops: TorchOps,
    x: torch.Tensor,  # [M, hidden]
    w: MlpWeights,
) -> torch.Tensor:  # [M, hidden], x.dtype
    return F.linear(ops.silu_and_mul(F.linear(x, w.gate_up)), w.down)


def down_fp32(
    a: torch.Tensor,  # [M, inter / C]
    down: torch.Tensor,  # [hidden, inter / C] (a strided column slice)
) -> torch.Tensor:  # [M, hidden] float32: a @ down.T with fp32 sums, not rounded to 16 bits
    if a.device.type == "cuda":
        return torch.mm(a, down.t(), out_dtype=torch.float32)
    return a.float() @ down.float().t()


def mlp_branches(
    ops: TorchOps,
    x: torch.Tensor,  # [M, hidden]
    w: MlpWeights,
    num_slices: int,
    side_streams: list,  # S - 1 side streams (empty: one stream)
) -> torch.Tensor:  # [M, hidden], x.dtype
    """Slice c's gate_up GEMM, SiLU-and-mul and fp32 down GEMM on stream c mod S (stream 0: the current one),
    forked from and joined back to the current stream; the partials are added in fp32 and rounded once."""
    main = torch.cuda.current_stream() if side_streams else None
    for s in side_streams:
        s.wait_stream(main)
    parts = []
    for c, (gate_up_c, down_c) in enumerate(w.sliced[num_slices]):
        lane = c % (len(side_streams) + 1)
        if lane == 0:
            parts.append(down_fp32(ops.silu_and_mul(F.linear(x, gate_up_c)), down_c))
            continue
        with torch.cuda.stream(side_streams[lane - 1]):
            parts.append(down_fp32(ops.silu_and_mul(F.linear(x, gate_up_c)), down_c))
    for s in side_streams:
        main.wait_stream(s)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total.to(x.dtype)


def graph_us(body, calls: int, replays: int = 5) -> float:
    """Microseconds per call: a CUDA graph of ``body()`` (``calls`` calls), median of ``replays`` replays."""
    import benchmarks.gpu_engine as ge
    return ge.graph_time_s(body, replays) / calls * 1e6


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        from specserve.layers.triton_ops import TritonOps
        ops: TorchOps = TritonOps()
    else:
        ops = TorchOps()
    config = shape_config("llama-3.1-8b")
    hidden, inter = (256, 512) if args.smoke else (config.hidden_size, config.intermediate_size)
    slices = tuple(int(c) for c in args.slices.split(","))
    streams = tuple(int(s) for s in args.streams.split(","))
    gen = torch.Generator(device=device).manual_seed(0)
    layers = [MlpWeights(torch.randn(2 * inter, hidden, device=device, dtype=dtype, generator=gen) * 0.02,
                         torch.randn(hidden, inter, device=device, dtype=dtype, generator=gen) * 0.02, slices)
              for _ in range(1 if args.smoke else args.copies)]
    side = [torch.cuda.Stream(device) for _ in range(max(streams) - 1)] if device.type == "cuda" else []
    variants = {"fused": lambda x, w: mlp_fused(ops, x, w)}
    for c in slices:
        for s in streams:
            if s <= c and (s == 1 or device.type == "cuda"):
                variants[f"c{c}_s{s}"] = lambda x, w, c=c, s=s: mlp_branches(ops, x, w, c, side[:s - 1])
    out: dict = {"hidden": hidden, "inter": inter, "copies": len(layers), "reps": args.reps, "by_rows": {}}
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, hidden, device=device, dtype=dtype, generator=gen)
        ref = mlp_fused(ops, x, layers[0]).float()
        row: dict = {"us": {}, "max_abs_diff": {}, "ref_max_abs": ref.abs().max().item()}
        for name, fn in variants.items():
            got = fn(x, layers[0]).float()
            row["max_abs_diff"][name] = (got - ref).abs().max().item()
            if device.type == "cuda":
                def body(fn=fn, x=x):
                    for _ in range(args.reps):
                        for w in layers:
                            fn(x, w)
                row["us"][name] = graph_us(body, args.reps * len(layers))
        if device.type == "cuda":  # the partials' fp32 sum alone, which the engine would fold into the residual add
            for c in slices:
                parts = [torch.randn(m, hidden, device=device, generator=gen) for _ in range(c)]

                def add(parts=parts, dtype=dtype):
                    for _ in range(args.reps * len(layers)):
                        total = parts[0]
                        for q in parts[1:]:
                            total = total + q
                        total.to(dtype)
                row.setdefault("sum_us", {})[f"c{c}"] = graph_us(add, args.reps * len(layers))
        if row["us"]:
            base = row["us"]["fused"]
            row["speedup_vs_fused"] = {k: base / v for k, v in row["us"].items()}
            flop = 2 * m * hidden * 3 * inter
            row["tflop_s"] = {k: flop / v / 1e6 for k, v in row["us"].items()}
        out["by_rows"][str(m)] = row
        print(f"rows {m:4d}: " + ", ".join(
            f"{k} {row['us'][k]:.1f} us (x{row['speedup_vs_fused'][k]:.3f}, diff {row['max_abs_diff'][k]:.2g})"
            if k in row["us"] else f"{k} diff {row['max_abs_diff'][k]:.2g}" for k in variants), flush=True)
    return out


def patch_branches(model, num_slices: int, num_streams: int, min_rows: int, device: torch.device):
    """Replace every decoder layer's ``mlp.forward`` by ``mlp_branches`` for inputs of at least ``min_rows`` rows
    (fewer: the layer's own forward) -> a function that restores them. bf16 layers only (``Linear`` weights)."""
    side = [torch.cuda.Stream(device) for _ in range(num_streams - 1)]
    saved = []
    for layer in model.layers:
        mlp = layer.mlp
        weights = MlpWeights(mlp.gate_up_proj.weight, mlp.down_proj.weight, (num_slices,))
        saved.append((mlp, mlp.__dict__.get("forward")))

        def forward(x, mlp=mlp, weights=weights, own=type(mlp).forward):
            if x.shape[0] < min_rows:
                return own(mlp, x)
            return mlp_branches(mlp.ops, x, weights, num_slices, side)
        mlp.forward = forward

    def restore() -> None:
        for mlp, before in saved:
            if before is None:
                del mlp.forward
            else:
                mlp.forward = before
    return restore


def engine_ab(args) -> dict:
    """Decode and verify steps of the engine's runner with the MLP fused and as branches (module docstring)."""
    import benchmarks.gpu_engine as ge
    from specserve.config import CacheConfig
    from specserve.engine.model_runner import ModelRunner

    device, batch, context = torch.device("cuda"), args.batch, args.context
    config = shape_config("llama-3.1-8b")
    model = ge.dummy_model(config, 2048, torch.bfloat16, device)
    runner = ModelRunner(model, config, CacheConfig(block_size=ge.BLOCK_SIZE, kv_cache_memory_gib=args.kv_gib), device)
    c, s = int(args.slices.split(",")[0]), int(args.streams.split(",")[-1])
    name = f"c{c}_s{s}"
    torch.manual_seed(0)
    inputs = ge.forward_inputs(runner, batch, context, 8)
    logits, times = {}, {"fused": {1: [], 8: []}, name: {1: [], 8: []}}
    for _ in range(args.rounds):
        for setting in ("fused", name):
            restore = patch_branches(model, c, s, args.min_rows, device) if setting == name else (lambda: None)
            try:
                ge.recapture(runner, batch)
                got = ge.time_forwards(runner, device, batch, context, (1, 8), args.iters, 1)
                for q in (1, 8):
                    times[setting][q].append(got[q])
                logits[setting] = ge.logits_of(runner, inputs, graphs=True).float()
            finally:
                restore()
    med = {k: {q: statistics.median(v) for q, v in t.items()} for k, t in times.items()}
    diff = (logits[name] - logits["fused"]).abs().max().item()
    agree = (logits[name].argmax(-1) == logits["fused"].argmax(-1)).float().mean().item()
    out = {"batch": batch, "context": context, "min_rows": args.min_rows, "step_s": med, "rounds_s": times,
           "verify8_vs_decode": {k: v[8] / v[1] for k, v in med.items()},
           "verify8_speedup": med["fused"][8] / med[name][8], "decode_speedup": med["fused"][1] / med[name][1],
           "verify_logits_max_abs_diff": diff, "verify_argmax_agreement": agree}
    print(json.dumps({k: out[k] for k in ("step_s", "verify8_vs_decode", "verify8_speedup", "decode_speedup",
                                         "verify_logits_max_abs_diff", "verify_argmax_agreement")}, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="small shapes, no timing: check each variant's maths")
    ap.add_argument("--rows", default="32,128,256")
    ap.add_argument("--slices", default="2,4")
    ap.add_argument("--streams", default="1,2")
    ap.add_argument("--copies", type=int, default=2, help="layers' weights per pass (352 MB each)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engine", action="store_true", help="also the engine's decode / verify steps (docstring)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--min-rows", type=int, default=128, help="--engine: branches for steps of at least this many rows")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=8.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    data = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
            "torch": torch.__version__}
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        data |= {"gpu": torch.cuda.get_device_name(), "sm_count": props.multi_processor_count}
    with torch.inference_mode():
        data |= run(args)
        if args.engine:
            import benchmarks.gpu_engine as ge
            ge.free(torch.device(args.device))
            data["engine"] = engine_ab(args)
    data["total_seconds"] = time.perf_counter() - t0
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
