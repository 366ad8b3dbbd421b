"""Quantized projection GEMMs on one GPU, in one run (GPU machine, not CI): bf16 ``F.linear`` against FP8 and
INT4 kernels on the Llama-3.1-8B projection shapes at decode row counts, with a tile-configuration sweep of the
Triton kernels. Prints tables and writes JSON (after every shape, so a run cut short keeps what it measured).

Shapes (N <- K): qkv 6144 <- 4096, o 4096 <- 4096, gate_up 28672 <- 4096, down 4096 <- 14336,
lm_head 128256 <- 4096; rows M in {1, 8, 32} (``--rows``). Methods, per (shape, M):

- ``bf16``: ``F.linear`` on the bf16 weight (cuBLAS);
- ``bf16_triton``: the Triton 16-bit GEMV (``layers/triton_gemv.py``) on the same bf16 weight with the
  configuration ``BF16_GEMV_TILES`` picks (what ``Linear`` and the LM head run for M <= ``BF16_GEMV_MAX_ROWS``,
  off by default); ``bf16_triton_best``: the fastest configuration of ``bf16_gemv_sweep``;
- ``w8a16``: the Triton W8A16 kernel (``layers/triton_w8a16.py``) with the configuration ``W8A16_TILES`` picks,
  activations quantized per token inside the kernel (what ``Fp8Linear`` runs up to
  ``W8A16_INKERNEL_QUANT_MAX_ROWS``); ``w8a16_prequant``: the fused quantizer, then the kernel on e4m3
  activations (same bits; ``Fp8Linear`` above that threshold); ``w8a16_noquant``: the kernel on unquantized
  activations (``act_quant="none"``, the maths before per-token quantization, for comparison);
  ``w8a16_e4m3``: the kernel on activations quantized beforehand, outside the timing (the engine's path: the
  producing norm or silu_and_mul quantizes, ``FUSE_FP8_ACT_QUANT``); its sweep (``w8a16_e4m3_sweep``) adds
  tiles for the fp8 MMA (``fp8_dot``);
- ``fp8_scaled_mm``: the fused Triton activation quantizer + ``torch._scaled_mm`` (what ``Fp8Linear`` runs
  above ``W8A16_MAX_ROWS``); ``fp8_scaled_mm_torch_quant``: the same GEMM after the old plain-torch quantizer;
  ``fp8_quant_only``: the fused quantizer alone;
- ``w4a16``: the Triton W4A16 kernel (``layers/triton_w4a16.py``) with ``W4A16_TILES``'s configuration;
- ``w8a16_best`` / ``w4a16_best``: the fastest configuration of the sweep (``w8a16_sweep`` / ``w4a16_sweep``).

Timing: a CUDA graph of ``--launches`` back-to-back calls (no Python or launch overhead), replayed ``--reps``
times between CUDA events; microseconds per call. The calls rotate over copies of the weights (enough to
exceed 256 MB) so that a weight is never still in L2 from the previous call, as in a decode step that streams
every layer. ``gb_s`` = weight bytes (with scales / zeros) per call / time; ``bw_fraction`` = ``gb_s`` / the
device-to-device copy bandwidth measured here (read + write bytes / time, as gpu_engine.py counts it).

Correctness, in the same run: every method and every swept configuration is checked against its fp32
reference (dequantized weights; ``fp8_linear_reference`` for the per-token FP8 methods, ``w8a16_linear_reference``
for ``w8a16_noquant``, ``int4_linear_reference``; fp32 ``x @ W.T`` for ``bf16`` and ``bf16_triton``)
by ``rel_err`` = ||out - ref|| / ||ref||; the fused quantizer against ``quantize_fp8_rows`` bit for bit. A
failing configuration is recorded (``errors``) and the run goes on.

What to read: ``summary`` (per shape and M: microseconds and speedup vs bf16 of each method),
``forward_gemm_ms`` (the projections of one 32-layer forward, LM head in bf16, per method) and ``suggested``
(per row bucket: the sweep configuration with the least total time over the four decoder-layer shapes, as
``TileConfig(...)`` lines for ``layers/quant_tiles.py``, and the largest M where the W8A16 kernel beats
_scaled_mm, for ``W8A16_MAX_ROWS``; ``bf16_triton`` tiles likewise, ``bf16_triton_lm_head`` per-shape entries for
the LM head, and ``bf16_gemv_max_rows``: the largest M (every measured M up to it winning) where the Triton GEMV's
forward projections, 32 layers with the suggested tiles + the LM head, beat ``F.linear``'s, for
``BF16_GEMV_MAX_ROWS``; 0 / None: keep cuBLAS). Row counts 2 and 4 are not measured by default: add them
(``--rows 1,2,4,8,32``) to decide the GEMV's buckets.

    python benchmarks/quant_gemm_gpu.py --out $OUT/quant_gemm_gpu.json
    python benchmarks/quant_gemm_gpu.py --smoke      # wiring check on CPU (Triton interpreter, tiny shapes)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_engine import copy_bandwidth, free, sync  # noqa: E402 - the engine script's measures
from specserve.layers.quant_tiles import TileConfig  # noqa: E402

SHAPES = {  # name -> (N out_features, K in_features), Llama-3.1-8B
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
LAYER_SHAPES = ("qkv", "o", "gate_up", "down")  # a decoder layer's projections (the LM head stays bf16)
NUM_LAYERS = 32
SMOKE_SHAPES = {"qkv": (48, 256), "down": (40, 512)}
DEFAULT_ROWS = (1, 8, 32)
SWEEP_KERNELS = ("bf16_triton", "w8a16", "w8a16_e4m3", "w4a16")  # the kernels with a tile sweep (``--sweeps``)
ROTATE_BYTES = 256 << 20  # weight copies per method: at least this many bytes, so L2 (50 MB) never holds one


# ---- sweeps: the configurations timed per row count (edit freely; quant_compile_check --sweep compiles them) ----
def w8a16_sweep(m: int) -> list[TileConfig]:
    """GEMV tiles sized so the per-row accumulators (BLOCK_M of 1, 2 or 4 rows) stay in registers, then
    tensor-core tiles (BLOCK_M = max(16, M))."""
    if m <= 1:
        gemv = [TileConfig(16, 512, 4, 1, use_dot=False), TileConfig(16, 1024, 8, 1, use_dot=False),
                TileConfig(8, 1024, 4, 1, use_dot=False), TileConfig(8, 512, 4, 1, use_dot=False),
                TileConfig(32, 256, 4, 1, use_dot=False), TileConfig(32, 512, 8, 1, use_dot=False),
                TileConfig(16, 512, 4, 1, split_k=2, use_dot=False),
                TileConfig(16, 256, 4, 1, split_k=0, use_dot=False)]
    elif m <= 2:
        gemv = [TileConfig(16, 256, 4, 1, use_dot=False), TileConfig(16, 512, 8, 1, use_dot=False),
                TileConfig(8, 512, 4, 1, use_dot=False), TileConfig(16, 256, 4, 1, split_k=0, use_dot=False)]
    else:  # 4-row tiles (M > 4: several, each reading the weights again)
        gemv = [TileConfig(16, 128, 4, 1, use_dot=False), TileConfig(8, 256, 4, 1, use_dot=False),
                TileConfig(16, 256, 8, 1, use_dot=False), TileConfig(16, 128, 4, 1, split_k=0, use_dot=False)]
    dot = [TileConfig(64, 128, 4, 4), TileConfig(64, 256, 4, 3), TileConfig(32, 256, 4, 4), TileConfig(64, 64, 4, 6),
           TileConfig(128, 128, 8, 3), TileConfig(128, 128, 4, 4), TileConfig(64, 128, 4, 4, split_k=0),
           TileConfig(32, 128, 4, 4, split_k=2)]
    if m <= 2:
        return gemv + dot[:3]
    if m <= 4:
        return gemv + dot
    return gemv[:1] + dot


def w8a16_e4m3_sweep(m: int) -> list[TileConfig]:
    """The W8A16 kernel on activations already quantized to e4m3 (the engine's path: the norm or silu_and_mul
    before the projection quantizes, ``FUSE_FP8_ACT_QUANT``): the first four tiles of ``w8a16_sweep`` (GEMV
    tiles for M <= 2), then tensor-core tiles where the fp8 MMA takes both e4m3 tiles as they are (``fp8_dot``),
    with deep pipelines and split K for the small N."""
    fp8 = [TileConfig(bn, bk, 4, st, split_k=sk, fp8_dot=True)
           for bn, bk, st, sk in ((64, 128, 4, 0), (64, 256, 4, 0), (64, 256, 6, 0), (128, 128, 4, 0),
                                  (128, 256, 4, 0), (128, 256, 3, 1), (64, 512, 3, 0), (128, 128, 6, 0))]
    return w8a16_sweep(m)[:4] + fp8


def bf16_gemv_sweep(m: int) -> list[TileConfig]:
    """The 16-bit GEMV (``layers/triton_gemv.py``; CUDA cores, one row tile of up to 4 rows): ``block_k`` of 256
    to 1024 bf16 (512 B to 2 KB per weight row per step), ``block_n`` 8 to 32, split K off / auto, and a
    pipelined variant (``num_stages`` 2). More than 4 rows: two configurations only (row tiles re-read W)."""
    if m <= 1:
        cfgs = [TileConfig(8, 512, 4, 1, use_dot=False), TileConfig(16, 512, 4, 1, use_dot=False),
                TileConfig(8, 1024, 8, 1, use_dot=False), TileConfig(16, 256, 4, 1, use_dot=False),
                TileConfig(32, 256, 8, 1, use_dot=False), TileConfig(8, 512, 4, 2, use_dot=False),
                TileConfig(8, 512, 4, 1, split_k=0, use_dot=False)]
    elif m <= 2:
        cfgs = [TileConfig(16, 256, 4, 1, use_dot=False), TileConfig(8, 512, 4, 1, use_dot=False),
                TileConfig(16, 512, 8, 1, use_dot=False), TileConfig(8, 256, 4, 1, use_dot=False),
                TileConfig(16, 256, 4, 1, split_k=0, use_dot=False)]
    else:
        cfgs = [TileConfig(16, 128, 4, 1, use_dot=False), TileConfig(8, 256, 4, 1, use_dot=False),
                TileConfig(16, 256, 8, 1, use_dot=False), TileConfig(8, 128, 4, 1, use_dot=False),
                TileConfig(16, 128, 4, 1, split_k=0, use_dot=False)]
    return cfgs if m <= 4 else cfgs[:2]


def w4a16_sweep(m: int) -> list[TileConfig]:
    gemv = [TileConfig(64, 128, 4, 1, use_dot=False), TileConfig(32, 128, 4, 1, use_dot=False),
            TileConfig(128, 128, 4, 1, use_dot=False), TileConfig(128, 128, 8, 1, use_dot=False),
            TileConfig(64, 64, 4, 1, use_dot=False), TileConfig(64, 128, 4, 1, split_k=0, use_dot=False),
            TileConfig(32, 128, 4, 1, split_k=0, use_dot=False), TileConfig(128, 128, 4, 1, split_k=0, use_dot=False)]
    bm = max(16, 1 << (m - 1).bit_length())
    dot = [TileConfig(64, 128, 4, 4, block_m=bm), TileConfig(64, 64, 4, 4, block_m=bm),
           TileConfig(128, 64, 4, 3, block_m=bm), TileConfig(32, 128, 4, 4, block_m=bm),
           TileConfig(64, 128, 4, 4, split_k=0, block_m=bm), TileConfig(64, 64, 4, 4, split_k=0, block_m=bm),
           TileConfig(128, 64, 8, 3, split_k=0, block_m=bm)]
    if m <= 2:
        return gemv + dot[:2]
    if m <= 4:
        return gemv[:4] + dot
    return gemv[:1] + gemv[5:6] + dot


# ---- helpers -------------------------------------------------------------------------------------------------------
def time_calls(fns: list, device: torch.device, launches: int, reps: int) -> tuple[float, str]:
    """Seconds per call of ``fns`` (called in rotation): CUDA-graph replay of ``launches`` calls on CUDA (eager
    calls between CUDA events if capture fails), wall time on CPU. Returns (seconds, how)."""
    for fn in fns:  # compile / autotune-free warm-up, eagerly
        fn()
    sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for i in range(max(1, reps)):
            fns[i % len(fns)]()
        return (time.perf_counter() - t0) / max(1, reps), "wall"
    run, how = _graph_replay(fns, device, launches), "graph"
    if run is None:
        how = "eager"

        def run() -> None:
            for i in range(launches):
                fns[i % len(fns)]()
        run()
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * launches), how


def _graph_replay(fns: list, device: torch.device, launches: int):
    """A function replaying a CUDA graph of ``launches`` calls of ``fns`` in rotation, or None if capture fails."""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(launches):
                fns[i % len(fns)]()
        graph.replay()
        sync(device)
    except Exception:  # noqa: BLE001 - some op refused capture: the caller times eager launches instead
        sync(device)
        return None
    return graph.replay


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def copies(tensors: tuple, nbytes: int, cap: int) -> list[tuple]:
    """``tensors`` and clones of them: enough copies that together they exceed ``ROTATE_BYTES`` (at most ``cap``)."""
    n = max(1, min(cap, -(-ROTATE_BYTES // max(1, nbytes))))
    return [tensors] + [tuple(None if t is None else t.clone() for t in tensors) for _ in range(n - 1)]


class Report:
    def __init__(self, command: str, out: str | None, budget_s: float) -> None:
        self.data: dict = {"command": command, "git_commit": git_commit(), "errors": {}}
        self.start = time.perf_counter()
        self.out = out
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def error(self, key: str, exc: BaseException) -> None:
        self.data["errors"][key] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        print(f"!!! {key}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)

    def write(self) -> None:
        if self.out:
            Path(self.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.out).write_text(json.dumps(self.data, indent=1, default=str) + "\n")


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_info(device: torch.device) -> dict:
    m = {"device": str(device), "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        m |= {"gpu": torch.cuda.get_device_name(device), "gpu_memory_gib": round(props.total_memory / 2**30, 1),
              "sm_count": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
              "l2_bytes": getattr(props, "L2_cache_size", None), "cuda": torch.version.cuda}
    try:
        m["triton"] = __import__("triton").__version__
    except Exception as exc:  # noqa: BLE001 - absent is a fact worth recording
        m["triton"] = f"unavailable ({type(exc).__name__})"
    return m


# ---- one shape ------------------------------------------------------------------------------------------------------
def bench_shape(rep: Report, args, name: str, n: int, k: int, device: torch.device, dtype: torch.dtype) -> None:
    """Weights of one shape (bf16, e4m3 + scales, int4 + scales / zeros, and rotation copies), then every M."""
    from specserve.layers.quant_gpu import quantize_fp8_rows, quantize_int4
    from specserve.layers.triton_splitk import split_counters

    gen = torch.Generator(device=device).manual_seed(0)
    w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype)  # [N, K]
    w8, w8_scale = quantize_fp8_rows(w)  # [N, K] e4m3, [N, 1] fp32
    w8_scale = w8_scale.reshape(1, -1).contiguous()  # [1, N]
    qweight, scales, zeros = quantize_int4(w, 128)  # [K // 8, N] int32, [K // 128, N] x2
    nbytes = {"bf16": w.numel() * w.element_size(), "fp8": w8.numel() + w8_scale.numel() * 4,
              "int4": qweight.numel() * 4 + 2 * scales.numel() * scales.element_size()}
    ctx = {"name": name, "n": n, "k": k, "gen": gen, "nbytes": nbytes, "counters": split_counters(n, device),
           "bf16": copies((w,), nbytes["bf16"], args.launches),
           "fp8": copies((w8, w8_scale), nbytes["fp8"], args.launches),
           "int4": copies((qweight, scales, zeros), nbytes["int4"], args.launches)}
    shape_out: dict = {"n": n, "k": k, "weight_bytes": nbytes, "by_rows": {},
                       "copies": {kind: len(ctx[kind]) for kind in ("bf16", "fp8", "int4")}}
    rep.data.setdefault("shapes", {})[name] = shape_out
    for m in args.rows:
        row: dict = {"m": m, "methods": {}, "sweep": {kernel: [] for kernel in SWEEP_KERNELS}}
        shape_out["by_rows"][str(m)] = row
        bench_row(rep, args, ctx, row, m, device, dtype)
        rep.write()


def bench_row(rep: Report, args, ctx: dict, row: dict, m: int, device: torch.device, dtype: torch.dtype) -> None:
    """Every method, then the sweeps, for one (shape, M)."""
    from specserve.layers import triton_gemv, triton_w4a16, triton_w8a16
    from specserve.layers.quant_gpu import (
        fp8_linear_reference,
        int4_linear_reference,
        quantize_fp8_rows,
        w8a16_linear_reference,
    )
    from specserve.layers.quant_tiles import BF16_GEMV_TILES, W4A16_TILES, W8A16_TILES

    name, n, k, nbytes, counters = ctx["name"], ctx["n"], ctx["k"], ctx["nbytes"], ctx["counters"]
    bf16_sets, fp8_sets, int4_sets = ctx["bf16"], ctx["fp8"], ctx["int4"]
    (w,), (w8, w8_scale), (qweight, scales, zeros) = bf16_sets[0], fp8_sets[0], int4_sets[0]
    bw = rep.data.get("copy_bandwidth_gb_s") or float("nan")
    x = torch.randn(m, k, generator=ctx["gen"], device=device).to(dtype)  # [M, K]
    # references: fp32 maths on the dequantized weights
    ref_bf16 = x.float() @ w.float().t()
    ref_w8a16 = w8a16_linear_reference(x.float(), w8, w8_scale, None)  # unquantized activations (noquant)
    ref_fp8 = fp8_linear_reference(x.float(), w8, w8_scale, None)  # per-token: w8a16, w8a16_prequant, _scaled_mm
    ref_int4 = int4_linear_reference(x.float(), qweight, scales, zeros, None)

    def record(method: str, fns: list, out: torch.Tensor | None, ref: torch.Tensor | None, weight_kind: str | None,
               tol: float | None, extra: dict | None = None) -> None:
        key = f"{name}.m{m}.{method}"
        try:
            sec, how = time_calls(fns, device, args.launches, args.reps)
        except Exception as exc:  # noqa: BLE001 - record and go on
            rep.error(key, exc)
            row["methods"][method] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            return
        res = {"us": sec * 1e6, "timing": how}
        if weight_kind:
            gbs = nbytes[weight_kind] / sec / 1e9
            res |= {"gb_s": gbs, "bw_fraction": gbs / bw}
        if out is not None and ref is not None:
            err = rel_err(out, ref)
            res |= {"rel_err": err, "ok": bool(err <= tol)}
            if not res["ok"]:
                rep.data["errors"][key + ".accuracy"] = f"rel_err {err:.3g} > {tol}"
        res |= extra or {}
        row["methods"][method] = res

    def w8a16(s, cfg=None, act_quant="per_token"):
        return triton_w8a16.w8a16_linear(x, s[0], s[1], None, config=cfg, counters=counters, act_quant=act_quant)

    x_q, x_s = triton_w8a16.quantize_fp8_rows_triton(x)  # what the fused norm / silu_and_mul hand the projection

    def w8a16_e4m3(s, cfg=None):
        return triton_w8a16.w8a16_linear(x_q, s[0], s[1], None, config=cfg, counters=counters,
                                         act_quant="per_token_prequant", x_scale=x_s, out_dtype=x.dtype)

    def bf16_triton(s, cfg=None):
        return triton_gemv.gemv_linear(x, s[0], None, config=cfg, counters=counters)

    def w4a16(s, cfg=None):
        return triton_w4a16.w4a16_linear(x, *s, None, config=cfg, counters=counters)

    def scaled_mm(s, quant):
        x_q, x_s = quant(x)
        return torch._scaled_mm(x_q, s[0].t(), scale_a=x_s, scale_b=s[1], out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    fused = triton_w8a16.quantize_fp8_rows_triton
    record("bf16", [lambda s=s: F.linear(x, s[0]) for s in bf16_sets], F.linear(x, w), ref_bf16, "bf16", 1e-2)
    record("bf16_triton", [lambda s=s: bf16_triton(s) for s in bf16_sets], _try(lambda: bf16_triton(bf16_sets[0])),
           ref_bf16, "bf16", 1e-2, {"config": BF16_GEMV_TILES.lookup(m, n, k).describe()})
    table_cfg = W8A16_TILES.lookup(m, n, k)
    w8_cfg = {"config": dataclasses.replace(table_cfg, fp8_dot=False).describe()}  # fp8_dot: e4m3 inputs only
    e4m3_cfg = {"config": table_cfg.describe()}
    # per-token modes: the reference's maths up to summation order and the bf16 output rounding (the unquantized
    # mode misses it by several percent), hence the tighter tolerance
    record("w8a16", [lambda s=s: w8a16(s) for s in fp8_sets], _try(lambda: w8a16(fp8_sets[0])), ref_fp8, "fp8",
           5e-3, w8_cfg)
    for mode, ref, tol in (("prequant", ref_fp8, 5e-3), ("noquant", ref_w8a16, 1e-2)):
        act = {"prequant": "per_token_prequant", "noquant": "none"}[mode]
        record(f"w8a16_{mode}", [lambda s=s, a=act: w8a16(s, act_quant=a) for s in fp8_sets],
               _try(lambda a=act: w8a16(fp8_sets[0], act_quant=a)), ref, "fp8", tol, w8_cfg)
    record("w8a16_e4m3", [lambda s=s: w8a16_e4m3(s) for s in fp8_sets], _try(lambda: w8a16_e4m3(fp8_sets[0])),
           ref_fp8, "fp8", 5e-3, e4m3_cfg)
    record("fp8_scaled_mm", [lambda s=s: scaled_mm(s, fused) for s in fp8_sets],
           _try(lambda: scaled_mm(fp8_sets[0], fused)), ref_fp8, "fp8", 2e-2)
    record("fp8_scaled_mm_torch_quant", [lambda s=s: scaled_mm(s, quantize_fp8_rows) for s in fp8_sets],
           _try(lambda: scaled_mm(fp8_sets[0], quantize_fp8_rows)), ref_fp8, "fp8", 2e-2)
    try:
        q_fused, s_fused = fused(x)
        q_ref, s_ref = quantize_fp8_rows(x)
        bitwise = bool(torch.equal(q_fused.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s_fused, s_ref))
    except Exception as exc:  # noqa: BLE001
        rep.error(f"{name}.m{m}.fp8_quant_bitwise", exc)
        bitwise = None
    if bitwise is False:
        rep.data["errors"][f"{name}.m{m}.fp8_quant_bitwise"] = "fused quantizer differs from quantize_fp8_rows"
    record("fp8_quant_only", [lambda: fused(x)], None, None, None, None, {"bitwise_equal_to_torch": bitwise})
    record("w4a16", [lambda s=s: w4a16(s) for s in int4_sets], _try(lambda: w4a16(int4_sets[0])), ref_int4, "int4",
           1e-2, {"config": W4A16_TILES.lookup(m, n, k).describe()})
    print_row(name, m, row)
    rep.write()
    if args.no_sweep:
        return
    for kernel, sweep, sets, kind, ref, call in (
            ("bf16_triton", bf16_gemv_sweep(m), bf16_sets, "bf16", ref_bf16, bf16_triton),
            ("w8a16", w8a16_sweep(m), fp8_sets, "fp8", ref_fp8, w8a16),
            ("w8a16_e4m3", w8a16_e4m3_sweep(m), fp8_sets, "fp8", ref_fp8, w8a16_e4m3),
            ("w4a16", w4a16_sweep(m), int4_sets, "int4", ref_int4, w4a16)):
        if kernel not in args.sweeps:
            continue
        for cfg in sweep:
            entry = {"config": cfg.describe(), "fields": dataclasses.asdict(cfg)}
            row["sweep"][kernel].append(entry)
            if rep.over_budget():
                entry["skipped"] = "time budget"
                continue
            try:
                err = rel_err(call(sets[0], cfg), ref)
                sec, how = time_calls([lambda s=s, c=cfg, f=call: f(s, c) for s in sets], device, args.launches,
                                      args.reps)
                gbs = nbytes[kind] / sec / 1e9
                entry |= {"us": sec * 1e6, "gb_s": gbs, "bw_fraction": gbs / bw, "rel_err": err,
                          "ok": bool(err <= 1e-2), "timing": how}
            except Exception as exc:  # noqa: BLE001 - one failing configuration must not stop the sweep
                rep.error(f"{name}.m{m}.sweep.{kernel}.{cfg.describe()}", exc)
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        good = [e for e in row["sweep"][kernel] if e.get("ok")]
        if good:
            best = min(good, key=lambda e: e["us"])
            row["methods"][f"{kernel}_best"] = {key: best[key] for key in ("us", "gb_s", "bw_fraction", "rel_err",
                                                                           "config")}
            print(f"    best {kernel:11s} {best['us']:9.1f} us {best['bw_fraction']:6.1%}  {best['config']}",
                  flush=True)


def _try(fn):
    """``fn()``, or None when it raises (the timing call records the error)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None


def print_row(name: str, m: int, row: dict) -> None:
    parts = []
    for method, res in row["methods"].items():
        if "us" in res:
            frac = f" {res['bw_fraction']:.0%}" if "bw_fraction" in res else ""
            bad = "" if res.get("ok", True) else " WRONG"
            parts.append(f"{method} {res['us']:.1f}us{frac}{bad}")
        else:
            parts.append(f"{method} FAILED")
    print(f"{name:8s} m={m:3d}: " + " | ".join(parts), flush=True)


# ---- summary ---------------------------------------------------------------------------------------------------------
def summarize(rep: Report, rows: list[int], shapes: list[str]) -> None:
    shapes_data = rep.data.get("shapes", {})
    summary: dict = {}
    for name, sd in shapes_data.items():
        for m, row in sd["by_rows"].items():
            base = row["methods"].get("bf16", {}).get("us")
            entry = {method: {"us": round(res["us"], 2), "bw_fraction": round(res.get("bw_fraction", float("nan")), 3),
                              "speedup_vs_bf16": round(base / res["us"], 3) if base else None}
                     for method, res in row["methods"].items() if "us" in res}
            summary.setdefault(name, {})[m] = entry
    rep.data["summary"] = summary
    # per row bucket: the sweep configuration with the least summed time over the decoder-layer shapes
    suggested: dict = {kernel: {} for kernel in SWEEP_KERNELS} | {
        "w8a16_max_rows": None, "bf16_triton_lm_head": {}, "bf16_gemv_max_rows": None}
    layer = [s for s in LAYER_SHAPES if s in shapes_data] or list(shapes_data)
    for kernel in SWEEP_KERNELS:
        for m in rows:
            totals: dict[str, float] = {}
            counts: dict[str, int] = {}
            for s in layer:
                for e in shapes_data[s]["by_rows"].get(str(m), {}).get("sweep", {}).get(kernel, []):
                    if e.get("ok"):
                        totals[e["config"]] = totals.get(e["config"], 0.0) + e["us"]
                        counts[e["config"]] = counts.get(e["config"], 0) + 1
            full = {c: t for c, t in totals.items() if counts[c] == len(layer)}
            if full:
                best = min(full, key=full.get)
                suggested[kernel][m] = {"config": best, "layer_us": round(full[best], 2),
                                        "per_shape_best_us": round(sum(
                                            shapes_data[s]["by_rows"][str(m)]["methods"].get(
                                                f"{kernel}_best", {}).get("us", float("nan")) for s in layer), 2)}
    # W8A16_MAX_ROWS: the largest M whose best W8A16 time (summed over layer shapes) beats _scaled_mm's
    wins = []
    for m in rows:
        w8 = suggested["w8a16"].get(m, {}).get("layer_us")
        mm = sum(shapes_data[s]["by_rows"].get(str(m), {}).get("methods", {}).get("fp8_scaled_mm", {}).get(
            "us", float("nan")) for s in layer)
        wins.append((m, w8, mm))
        if w8 is not None and mm == mm and w8 < mm:
            suggested["w8a16_max_rows"] = m
    suggested["w8a16_vs_scaled_mm_layer_us"] = {m: {"w8a16_best": a, "scaled_mm": round(b, 2)} for m, a, b in wins}
    rep.data["suggested"] = suggested

    def method_us(shape: str, m: int, method: str) -> float | None:
        return shapes_data.get(shape, {}).get("by_rows", {}).get(str(m), {}).get("methods", {}).get(
            method, {}).get("us")

    # the projections of one Llama-3.1-8B forward (32 layers; the LM head in bf16, as the engine keeps it, except
    # for the bf16_triton methods, whose routing covers the LM head too)
    estimate: dict = {}
    for m in rows:
        per: dict = {}
        for method in ("bf16", "bf16_triton", "bf16_triton_best", "w8a16", "w8a16_prequant", "w8a16_noquant",
                       "w8a16_best", "w8a16_e4m3", "w8a16_e4m3_best", "fp8_scaled_mm", "w4a16", "w4a16_best"):
            times = [method_us(s, m, method) for s in LAYER_SHAPES]
            head = method_us("lm_head", m, method if method.startswith("bf16_triton") else "bf16")
            if all(t is not None for t in times) and head is not None:
                per[method] = round((NUM_LAYERS * sum(times) + head) / 1e3, 3)
        if "bf16" in per:
            per["speedup_vs_bf16"] = {k: round(per["bf16"] / v, 3) for k, v in per.items() if k != "bf16"}
        estimate[m] = per
    rep.data["forward_gemm_ms"] = estimate
    # BF16_GEMV_MAX_ROWS: the Triton GEMV with one configuration per row bucket (the suggested one) on every layer
    # shape and the LM head's best, against F.linear, per forward; the largest M up to which every measured M wins
    gemv_vs: dict = {}
    for m in sorted(rows):
        layer_us = suggested["bf16_triton"].get(m, {}).get("layer_us")
        head_best = shapes_data.get("lm_head", {}).get("by_rows", {}).get(str(m), {}).get("methods", {}).get(
            "bf16_triton_best", {})
        if head_best.get("config"):
            suggested["bf16_triton_lm_head"][m] = head_best["config"]
        head = head_best.get("us") or method_us("lm_head", m, "bf16_triton")
        if layer_us is None:  # no sweep (--no-sweep): the table's configuration
            times = [method_us(s, m, "bf16_triton") for s in LAYER_SHAPES]
            layer_us = sum(times) if all(t is not None for t in times) else None
        base = estimate.get(m, {}).get("bf16")
        gemv_ms = round((NUM_LAYERS * layer_us + head) / 1e3, 3) if layer_us is not None and head else None
        gemv_vs[m] = {"bf16_triton_ms": gemv_ms, "f_linear_ms": base,
                      "speedup": round(base / gemv_ms, 3) if gemv_ms and base else None}
    for m, e in gemv_vs.items():
        if not (e["speedup"] and e["speedup"] > 1.0):
            break
        suggested["bf16_gemv_max_rows"] = m
    suggested["bf16_triton_vs_f_linear_forward"] = gemv_vs
    rep.data["definitions"] = {
        "us": "microseconds per call: CUDA-graph replay of back-to-back calls over rotating weight copies",
        "gb_s": "weight bytes (incl. scales / zeros) per call / time",
        "bw_fraction": "gb_s / copy_bandwidth_gb_s (device-to-device copy, read + write bytes / time)",
        "rel_err": "||out - ref|| / ||ref||, ref = fp32 maths on the dequantized weights",
        "forward_gemm_ms": f"{NUM_LAYERS} x (qkv + o + gate_up + down) + bf16 lm_head, ms: the projection part "
                           "of one forward of M tokens (compare with gpu_engine.py's decode step)",
        "suggested": "per row bucket, the sweep configuration with the least time summed over qkv, o, gate_up, "
                     "down (paste into layers/quant_tiles.py); w8a16_max_rows: largest M where it beats _scaled_mm; "
                     "bf16_gemv_max_rows: largest M up to which the Triton bf16 GEMV (suggested tiles, LM head "
                     "included) beats F.linear per forward at every measured M (BF16_GEMV_MAX_ROWS; None: keep 0)",
    }


def print_summary(rep: Report) -> None:
    methods = ("bf16", "bf16_triton", "bf16_triton_best", "w8a16", "w8a16_prequant", "w8a16_noquant",
               "w8a16_best", "fp8_scaled_mm", "fp8_scaled_mm_torch_quant", "w4a16", "w4a16_best")
    print("\nus per call (x speedup vs bf16)")
    print(f"{'shape':8s} {'m':>3s} " + " ".join(f"{mth:>22s}" for mth in methods))
    for name, by_m in rep.data.get("summary", {}).items():
        for m, entry in by_m.items():
            cells = []
            for mth in methods:
                e = entry.get(mth)
                cells.append(f"{e['us']:9.1f} (x{e['speedup_vs_bf16'] or 0:5.2f})" if e else f"{'-':>22s}")
            print(f"{name:8s} {m:>3s} " + " ".join(f"{c:>22s}" for c in cells))
    sug = rep.data.get("suggested", {})
    print("\nsuggested tile tables (layers/quant_tiles.py):")
    for kernel in SWEEP_KERNELS:
        for m, e in sug.get(kernel, {}).items():
            print(f"  {kernel} rows<={m}: {e['config']}  # {e['layer_us']} us per layer "
                  f"(per-shape best {e['per_shape_best_us']})")
    print(f"  W8A16_MAX_ROWS: {sug.get('w8a16_max_rows')}  {sug.get('w8a16_vs_scaled_mm_layer_us')}")
    for m, cfg in sug.get("bf16_triton_lm_head", {}).items():
        print(f"  bf16_triton lm_head rows<={m}: {cfg}")
    print(f"  BF16_GEMV_MAX_ROWS: {sug.get('bf16_gemv_max_rows') or 0}  "
          f"{sug.get('bf16_triton_vs_f_linear_forward')}")
    for m, per in rep.data.get("forward_gemm_ms", {}).items():
        print(f"projections of one forward, m={m}: {per}")
    if rep.data.get("errors"):
        print(f"errors ({len(rep.data['errors'])}): {', '.join(list(rep.data['errors'])[:20])}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/quant_gemm_gpu.json, else "
                                                 "benchmarks/results/quant_gemm_gpu.json)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help="row counts M, comma-separated")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="shape names, comma-separated")
    ap.add_argument("--launches", type=int, default=20, help="calls per CUDA graph (and max weight copies)")
    ap.add_argument("--reps", type=int, default=10, help="graph replays timed")
    ap.add_argument("--no-sweep", action="store_true", help="time the tables' configurations only")
    ap.add_argument("--sweeps", default=",".join(SWEEP_KERNELS),
                    help="the kernels whose tile sweeps run, comma-separated")
    ap.add_argument("--time-budget-s", type=float, default=150.0,
                    help="sweep configurations not yet started after this many seconds are skipped")
    ap.add_argument("--smoke", action="store_true", help="CPU wiring check: Triton interpreter, tiny shapes")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        from tests.triton_interpreter import fix_interpreter
        fix_interpreter()
        args.device, args.launches, args.reps = "cpu", 2, 1
    if args.out is None:
        args.out = str(Path(os.environ.get("OUT", ROOT / "benchmarks" / "results")) / "quant_gemm_gpu.json")
    args.rows = [int(r) for r in args.rows.split(",") if r]
    args.sweeps = set(args.sweeps.split(","))
    unknown = args.sweeps - set(SWEEP_KERNELS)
    if unknown:
        ap.error(f"--sweeps: unknown kernel(s) {', '.join(sorted(unknown))}")
    shapes = SMOKE_SHAPES if args.smoke else {s: SHAPES[s] for s in args.shapes.split(",") if s}
    device = torch.device(args.device)
    dtype = torch.bfloat16
    rep = Report(" ".join(["python", *sys.argv]), args.out, args.time_budget_s)
    rep.data |= {"machine": machine_info(device), "rows": args.rows, "launches": args.launches, "reps": args.reps}
    try:
        bw = copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**24)
        rep.data["copy_bandwidth_gb_s"] = bw / 1e9
        print(f"copy bandwidth (read + write): {bw / 1e9:.0f} GB/s", flush=True)
    except Exception as exc:  # noqa: BLE001
        rep.error("bandwidth", exc)
    for name, (n, k) in shapes.items():
        print(f"--- {name} {n} <- {k} ({rep.elapsed():.0f} s)", flush=True)
        try:
            with torch.inference_mode():
                bench_shape(rep, args, name, n, k, device, dtype)
        except Exception as exc:  # noqa: BLE001 - one shape failing keeps the others
            rep.error(name, exc)
        free(device)
        rep.write()
    summarize(rep, args.rows, list(shapes))
    rep.data["total_seconds"] = round(rep.elapsed(), 1)
    rep.write()
    print_summary(rep)
    print(f"wrote {args.out} ({rep.data['total_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
