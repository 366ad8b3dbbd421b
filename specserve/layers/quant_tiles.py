"""Tile configurations of the quantized GEMM kernels (``layers/triton_w8a16.py``, ``layers/triton_w4a16.py``) and
of the 16-bit-weight GEMV (``layers/triton_gemv.py``): one table per kernel, keyed by a bucket of row counts M,
optionally refined per weight shape ``(N, K)``.

The entries are meant to be re-chosen from ``benchmarks/quant_gemm_gpu.py`` on the target GPU: it sweeps tile
configurations per (shape, M) and prints the best ones as ``TileConfig(...)`` lines ready to paste here. A
benchmark (or a test) can also override a lookup for a while with ``override``:

    with override(W8A16_TILES, {1: TileConfig(block_n=16, block_k=512, num_warps=4, use_dot=False)}):
        ...

Nothing here imports Triton; the kernels read the table at call time (so edits and overrides apply to the next
call; a CUDA graph keeps what it captured).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration of a quantized GEMM.

    - ``block_n`` x ``block_k``: the weight tile one program reads per loop step (output channels x input
      features); ``block_m`` rows of activations per program (0: the smallest power of two >= M, at least 16
      on the tensor-core path), so at small M one program column covers every row and each weight is read once.
    - ``use_dot``: True multiplies on the tensor cores (``tl.dot``; BLOCK_M >= 16, padded rows cost nothing but
      issue slots); False on the CUDA cores (fp32 FMAs of a [BLOCK_M, ...] broadcast): the GEMV path for M of
      1 to a few, where the tensor-core path would waste 15/16 of its work and needs its operands in shared
      memory.
    - ``split_k``: programs per output tile along K (1: none; 0: auto, enough programs for ``waves`` waves of
      the GPU's multiprocessors). Split partial sums are reduced inside the same launch (the last program of a
      tile to finish adds them in a fixed order: deterministic, no second kernel).
    - ``num_warps`` / ``num_stages``: Triton launch options (warps per program, software-pipelining depth of
      the loads that feed ``tl.dot``).
    - ``group_m`` / ``tma`` (the 16-bit GEMM, ``layers/triton_gemm.py``, only): row tiles per group of the
      program order (neighbouring programs share a weight tile), and operand loads through the tensor memory
      accelerator instead of pointer loads.
    - ``fp8_dot`` (W8A16 on e4m3 activations only): the tensor cores multiply the e4m3 weight and activation
      tiles as they are (an fp8 MMA), instead of converting both to fp16 in registers first; the weight tiles
      then stream through shared memory in ``num_stages`` stages without touching the registers.
    - ``prefetch`` (W8A16 on the tensor cores only): the first 0, 1 or 2 weight tiles of each program's K range
      are loaded into registers before the programmatic-dependent-launch wait (``layers/triton_pdl.py``), so
      their HBM reads may overlap the kernel before; they are multiplied after the loop over the rest.
    """

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    block_m: int = 0
    use_dot: bool = True
    fp8_dot: bool = False
    prefetch: int = 0
    group_m: int = 8
    tma: bool = False

    def __post_init__(self) -> None:
        if self.prefetch not in (0, 1, 2):
            raise ValueError(f"TileConfig.prefetch: {self.prefetch} is not 0, 1 or 2")

    def describe(self) -> str:
        return (f"TileConfig(block_n={self.block_n}, block_k={self.block_k}, num_warps={self.num_warps}, "
                f"num_stages={self.num_stages}, split_k={self.split_k}, block_m={self.block_m}, "
                f"use_dot={self.use_dot}" + (", fp8_dot=True" if self.fp8_dot else "")
                + (f", prefetch={self.prefetch}" if self.prefetch else "")
                + (f", group_m={self.group_m}" if self.group_m != 8 else "") + (", tma=True" if self.tma else "")
                + ")")


@dataclass
class TileTable:
    """Configurations by row bucket: ``by_rows[b]`` serves every M with previous bucket < M <= b (the last bucket
    serves every larger M too); ``by_shape[(N, K)]`` is a table of the same form tried first for that shape."""

    by_rows: dict[int, TileConfig]
    by_shape: dict[tuple[int, int], dict[int, TileConfig]]

    def lookup(self, m: int, n: int, k: int) -> TileConfig:
        for table in (self.by_shape.get((n, k)), self.by_rows):
            if table:
                return _bucket(table, m)
        raise KeyError("empty tile table")


def _bucket(table: Mapping[int, TileConfig], m: int) -> TileConfig:
    keys = sorted(table)
    return table[next((b for b in keys if m <= b), keys[-1])]


@contextlib.contextmanager
def override(table: TileTable, by_rows: Mapping[int, TileConfig] | None = None,
             by_shape: Mapping[tuple[int, int], Mapping[int, TileConfig]] | None = None) -> Iterator[None]:
    """Replace ``table``'s entries inside a ``with`` block (benchmarks: time one configuration at a time)."""
    saved = (table.by_rows, table.by_shape)
    table.by_rows = dict(by_rows) if by_rows is not None else table.by_rows
    table.by_shape = {key: dict(v) for key, v in by_shape.items()} if by_shape is not None else table.by_shape
    try:
        yield
    finally:
        table.by_rows, table.by_shape = saved


# ---- the tables ------------------------------------------------------------------------------------------------
# Picked from benchmarks/quant_gemm_gpu.py on an H200 (benchmarks/results/quant_gemm_gpu.json, "suggested": the
# config with the least summed time over Llama-3.1-8B's qkv / o / gate_up / down projections per row bucket).
# FP8 weights (e4m3, per-channel scales) x activations quantized per token (e4m3). Fp8Linear runs rows <=
# W8A16_MAX_ROWS through this kernel and more rows through torch._scaled_mm (after the fused quantizer):
# at 32 rows W8A16 still beat the fused quantizer + _scaled_mm (102.6 vs 113.1 us per layer; measured when the
# W8A16 kernel did not quantize activations: re-time).
W8A16_MAX_ROWS = 32
# The W8A16 kernel quantizes activations per token itself (an amax pass over each program's rows of x, then
# e4m3 rounding in registers: no extra launch) up to this many rows; above it, up to W8A16_MAX_ROWS, the fused
# quantizer runs first and the kernel reads e4m3 activations (one more launch, but each program of a split-K
# launch no longer re-reads all of x for the amax). Both give the same bits. Re-time with quant_gemm_gpu.py
# (methods w8a16 vs w8a16_prequant).
# Measured on the H200 (benchmarks/results/quant_gemm_gpu_nosweep.json): quantizing inside the kernel re-reads x
# for the amax in every program and was slower at every M (m=1 forward projections 4.04 ms vs 2.94 ms with the
# fused quantizer first; m=8: 12.4 vs 3.3), so the fused quantizer always runs first.
W8A16_INKERNEL_QUANT_MAX_ROWS = 0
# Up to 32 rows: the fp8 MMA on the e4m3 activations the fused ops hand over (``fp8_dot``), 64 x 128 weight tiles
# four stages deep, K split to fill the GPU. On the H200 (benchmarks/results/quant_gemm_fp8dot_gpu.json, pre-quantized
# activations as in the engine) the four Llama-8B projections of a layer took 65.9 us at M = 1 (the CUDA-core GEMV
# before it: 71.7; gate_up 30.7 vs 35.9 us, 90% of copy bandwidth) and 67.6 us at M = 8 (the fp16-converting
# MMA before it: 83.6). Rows 9 to 32 take the same tile: whole FP8 engine steps on an H100, two runs
# (benchmarks/fp8_rows_ab_gpu.py, fp8_rows_ab_h100_run1/2.json), against the fp16-converting MMA they had: decode at
# batch 16 4.92 -> 4.44 ms (x1.33 -> x1.47 over bf16), batch 32 5.61 -> 5.04 (x1.23 -> x1.37), an 8-token verify at
# batch 4 (32 rows) 5.15 -> 4.61 ms; batch 8 unchanged (x1.52 / x1.55). The other tiles that quant_gemm_gpu.py
# suggested at 16 and 32 rows (quant_gemm_rows16_64_h100.json: block_k 256; a 32-wide fp16 MMA tile) were slower
# in the step (fp8_k256, fp8_k256_n32 there); through the W8A16 kernel at 64 rows the step lost to _scaled_mm
# (fp8_dot64 in run 1), so W8A16_MAX_ROWS stays 32. The logits of every variant are as far from bf16's as the
# previous table's (relative L2 0.45 on the dummy 8B model, which amplifies any e4m3 rounding difference).
# Numerics: see triton_w8a16's docstring (the fp8 MMA's partial sums of 32 products).
# Up to 8 rows each program also loads its first weight tile before the programmatic-dependent-launch wait
# (``prefetch`` 1). Whole FP8 engine steps on an H100, two runs in opposite method order (benchmarks/
# quant_rows_ab_gpu.py, fp8_prefetch_ab_h100_run1/2.json), against the same tile without: decode batch 1 3.755 /
# 3.754 -> 3.711 / 3.708 ms (x1.51 -> x1.53 over bf16), batch 8 4.283 / 4.218 -> 4.127 / 4.140, the 1-token
# forward at batch 4 3.989 / 3.981 -> 3.936 / 3.934; batch 32 (and the 32-row verify) 2% slower, so rows 9 to 32
# keep prefetch 0. Two tiles (prefetch 2) were slower at every batch, and so was EARLY_LAUNCH with or without it.
# Warming the L2 instead, with a small kernel in each window of short kernels that asked for the next projection's
# first weight bytes (cp.async.bulk.prefetch.L2 or prefetch.global.L2, budgets of 4-16 MiB a window or all of o_proj
# during attention; commit abb23da, benchmarks/results/weight_prefetch_ab_h100.json), slowed every step on an H100:
# FP8 b1 graph replay 3.309 -> 3.354 ms (o_proj only) to 3.578-3.693 (all four windows), bf16 5.258 -> 5.290-5.567,
# b4 / b8 and the 8-token verify alike (logits equal bit for bit), so it was removed.
# Same products, another fp32 sum order (the prefetched tile is added after the loop); the 32-row verify logits of
# the prefetching table equalled the committed one's bit for bit in both runs (logits_vs_fp8 0.0). Rows 1-8 and
# 9-32 thus sum in different orders, so a token's FP8 projections may differ in their last bits between a small
# decode step and a 9-32-row verify, as they already could between MMA tiles of 16 and 32 rows.
# Tried on an H100 in stop 44 and not kept (commit b81dd64 has the code; whole FP8 steps side by side in one run):
# - one tile for all four shapes beats per-shape tiles in the step, although alone 32 x 256 (down) and 32 x 128
#   (qkv, o) read 4-14% faster at one row: b1 3.57 -> 3.63 ms, b8 3.97 -> 4.03 (benchmarks/w8a16_shapes_gpu.py,
#   results/w8a16_shapes_h100.json); split K for 2 waves of programs beats 1 and 4 (b1 x0.982 / x0.933:
#   benchmarks/fp8_step_knobs_gpu.py, results/fp8_step_knobs_h100.json);
# - the quantizer launches before down and o_proj folded into this kernel (16-bit activations with the maxima their
#   producers computed: the split silu_and_mul_fp8's blocks, per-(token, head) maxima stored by the attention
#   kernels; each tile divided in registers): logits equal bit for bit, but b1 3.57 -> 3.86 / 3.91 ms and b8 3.97
#   -> 4.91 / 5.13 (w8a16_shapes_h100.json, settings defer_silu / defer), as with X_MODE 1 above: the division in
#   every program costs more than the launch it saves;
# - weights packed so that each 64 x 128 tile is one contiguous 8 KiB block: projections alone x0.98-1.01, the b1
#   step x1.015 (results/fp8_tiles_h100.json), at the price of a second FP8 copy of every weight for the
#   _scaled_mm path above 32 rows.
# Stop 48, H100, the same A/B (benchmarks/fp8_step_knobs_gpu.py TILE_SETTINGS, results/fp8_step_tiles_h100.json): at
# one row the CUDA-core GEMV without split K for o, qkv or both (8 x 512 or 16 x 512 tiles, as the bf16 step's GEMV),
# o in 2 splits or on 32-wide MMA tiles: every one within x0.983-1.005 of this table at b1 and b8.
W8A16_TILES = TileTable(
    by_rows={
        8: TileConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=0, fp8_dot=True, prefetch=1),
        32: TileConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=0, fp8_dot=True),
        64: TileConfig(block_n=64, block_k=128, num_warps=4, num_stages=3),
    },
    by_shape={},
)

# INT4 group-wise weights (AWQ layout) x 16-bit activations: every M (prefill too) runs through this kernel.
# Rows 17-32 take K tiles of 128 since stop 41 (64 before): on the H200, side by side in one run
# (benchmarks/quant_rows_ab_gpu.py, results/quant_rows_r32_h200.json, method int4_r32_bk128), the batch-32 decode
# step 7.37 -> 7.00 ms and the 32-row verify forward (batch 4 x 8 tokens) 7.24 -> 6.71 ms; 8 warps instead lost
# (8.21 / 7.86 ms), and so did the lookahead at 32 rows with 8 warps or 32-column tiles. Not yet timed on an H100.
W4A16_TILES = TileTable(
    by_rows={
        1: TileConfig(block_n=128, block_k=128, num_warps=4, num_stages=1, split_k=0, use_dot=False),
        16: TileConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=0, block_m=16),
        32: TileConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=0, block_m=32),
        64: TileConfig(block_n=64, block_k=64, num_warps=4, num_stages=4, split_k=0, block_m=64),
        256: TileConfig(block_n=128, block_k=64, num_warps=4, num_stages=3, block_m=64),
        4096: TileConfig(block_n=128, block_k=64, num_warps=8, num_stages=3, block_m=128),
    },
    by_shape={},
)

# bf16 / fp16 weights (no quantization) x activations of the same dtype, the GEMV on the CUDA cores
# (layers/triton_gemv.py; only block_n, block_k, split_k, num_warps, num_stages apply). Opt-in: Linear (and the LM
# head, layers/linear.dense_linear) run 0 < M <= BF16_GEMV_MAX_ROWS rows through it on CUDA; 0 keeps F.linear
# (cuBLAS) everywhere. benchmarks/quant_gemm_gpu.py (method bf16_triton) suggests both the tiles and the row
# limit: at M = 2 cuBLAS was already faster (0.93x), at M = 4 and 8 far faster, so only M = 1 takes the kernel.
BF16_GEMV_MAX_ROWS = 1
# ... and only for weights of at least this many elements. Timed on the H200 (benchmarks/results/
# quant_gemm_gpu.json, fp8_b1_session12.json): at M = 1 the kernel beats cuBLAS on every Llama-8B projection
# (1.11x per forward's projections, 1.8-2.0x on the LM head; the b=1 decode graph 4.42 -> 4.13 ms); the
# small projections of a 135M model (0.3-1.8M elements, too few N tiles to fill the GPU) were not timed
# separately and keep cuBLAS; its 28M-element LM head takes the kernel.
BF16_GEMV_MIN_WEIGHT = 4 << 20
BF16_GEMV_TILES = TileTable(
    by_rows={
        1: TileConfig(block_n=8, block_k=512, num_warps=4, num_stages=1, split_k=1, use_dot=False),
        2: TileConfig(block_n=16, block_k=256, num_warps=4, num_stages=1, split_k=1, use_dot=False),
        4: TileConfig(block_n=16, block_k=128, num_warps=4, num_stages=1, split_k=1, use_dot=False),
    },
    by_shape={},
)

# Fuse the per-token FP8 activation quantizer into the ops that produce the qkv / gate_up / down inputs
# (TritonOps.rms_norm_fp8 / fused_add_rms_norm_fp8 / silu_and_mul_fp8, read at call time by models/llama.py,
# so set it before the engine captures its CUDA graphs): 3 fewer launches per layer, the same e4m3 bits (checked
# on the H200: fused_bitwise). On: with asynchronous decode steps the b=1 FP8 step went from 3.33 to 3.24 ms
# (benchmarks/results/fp8_b1_session13.json; under a per-step device sync it had measured no gain).
FUSE_FP8_ACT_QUANT = True

# The FP8 MLP block of a one-row step (a batch-1 decode) as one persistent launch (layers/triton_fused_mlp.py:
# residual add + RMSNorm + e4m3 quantizer + gate|up + SiLU-and-mul + barrier + down, instead of five launches),
# when the model's shapes tile: {"bn1", "bk1", "bn2", "bk2", "num_warps", "stages"} and "programs_per_sm", or None
# (off). Read at every layer call (models/llama.py), so set it before the engine captures its CUDA graphs.
# Off: on an H100 the block alone ties the five launches (69.5 vs 68.8 us, benchmarks/results/
# persistent_mlp_twobarrier_h100.json) and the whole b1 FP8 step with it on is slower (graph replay 4.13 vs 3.28 ms,
# fp8_b1_fused_mlp_h100.json; 6.35 vs 3.23 ms in stop 45's run, fp8_b1_streamk_chain_h100.json).
# Tried in stop 45 and removed (commit c4b67eb has the code, layers/triton_streamk_mlp.py): the same block with its
# products on the tensor cores (e4m3 wgmma on 64-row tiles; narrower fp8 tiles compile to fp16 MMAs behind a
# conversion of every weight) and the work shared out stream-K (every program an equal range of K chunks, tiles cut
# between programs summed in slot order by the last to arrive). Bit for bit the five launches' output at every
# tiling, but 74-87 us a block on an H100 against their 67.9-70.9 (results/persistent_mlp_streamk_h100.json): faster
# with more weight bytes in flight per multiprocessor (16 KiB chunks, 6 stages, 2 programs a multiprocessor) up to
# ~75 us and no further; asking each program's first 64-256 KiB of down weights into L2 before the barriers
# (prefetch.global.L2) added 0.3-3 us (persistent_mlp_streamk_pf_h100.json).
FUSED_MLP_ONE_ROW: dict | None = None

# bf16 / fp16 weights at verify row counts on the tensor cores (layers/triton_gemm.py): per weight shape (N, K), row
# buckets (an entry serves previous bucket < M <= bucket; the first serves BF16_GEMM_MIN_ROWS < M <= it) -> the
# configuration, or None for cuBLAS. Shapes and row counts without an entry keep cuBLAS. Only shapes where
# benchmarks/triton_gemm_gpu.py timed the kernel faster than cuBLAS belong here. Empty: on the H200 cuBLAS won on
# every Llama-3.1-8B weight at M = 256 and all but gate_up at M = 128 (x1.04 there, no measurable step gain;
# benchmarks/results/triton_gemm_gpu.json). cuBLASLt's other heuristic candidates for the same GEMMs win x1.00-1.07
# per GEMM over torch's cuBLAS call on an H100, 2% of the GEMM time at 256 rows and 1% at 32 (benchmarks/
# cublaslt_algos_gpu.py, results/cublaslt_algos_h100.json); configurations beyond the heuristic's do better at 256
# rows: BF16_LT_ALGOS below.
BF16_GEMM_MIN_ROWS = 64
BF16_GEMM_TILES: dict[tuple[int, int], dict[int, TileConfig | None]] = {}

# 16-bit weights at verify row counts through cuBLASLt with a measured algorithm configuration (layers/
# cublaslt_gemm.py; EngineConfig.cublaslt_algos): weight shape (N, K) -> [(lo, hi, config)], an entry serving
# lo < M <= hi rows. The configurations are those cuBLASLt's search found fastest on the H200 at 256 rows (a batch
# of 32 x 8 verify tokens), beyond the 8 candidates its heuristic offers (benchmarks/cublaslt_algos_gpu.py
# --search-max 100, results/cublaslt_search_h200.json): per call o_proj 17.5 -> 14.5 us, down 48.2 -> 44.5,
# qkv 21.6 -> 19.9, gate_up 89.1 -> 86.0 (x1.20 / 1.08 / 1.09 / 1.04 over torch's call, same output but for one
# bf16 rounding step on down), 0.37 ms over the 32 layers of a verify step. At 32 rows the heuristic's first choice
# was already the fastest (x1.00, cublaslt_search_32_h200.json): decode steps keep torch's call. Algorithm 66 of
# sm_90's cuBLASLt; cublasLtMatmulAlgoCheck vets each for the GPU at hand (rejected: torch's call).
_LT_O_DOWN = {"id": 66, "tile_id": 18, "stages_id": 35, "splitk_num": 1, "custom_option": 0, "cluster_shape_id": 2}
BF16_LT_ALGOS: dict[tuple[int, int], list[tuple[int, int, dict]]] = {
    (6144, 4096): [(192, 256, {"id": 66, "tile_id": 28, "stages_id": 35, "splitk_num": 1, "custom_option": 4,
                               "cluster_shape_id": 2})],  # Llama-3.1-8B qkv: TILE_96x128
    (4096, 4096): [(192, 256, _LT_O_DOWN)],  # o_proj: TILE_128x64
    (28672, 4096): [(192, 256, {"id": 66, "tile_id": 165, "stages_id": 35, "splitk_num": 1, "custom_option": 2,
                                "cluster_shape_id": 5})],  # gate_up: TILE_112x128
    (4096, 14336): [(192, 256, _LT_O_DOWN)],  # down: TILE_128x64
}


def bf16_gemm_config(m: int, n: int, k: int) -> TileConfig | None:
    """``BF16_GEMM_TILES``'s configuration for M rows of an (N, K) weight, or None (cuBLAS): no entry for the
    shape, M <= ``BF16_GEMM_MIN_ROWS``, M above the shape's largest bucket, or a None entry."""
    table = BF16_GEMM_TILES.get((n, k))
    if not table or m <= BF16_GEMM_MIN_ROWS:
        return None
    bucket = next((b for b in sorted(table) if m <= b), None)
    return None if bucket is None else table[bucket]
