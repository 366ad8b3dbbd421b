"""The FP8 decode step of the dummy Llama-3.1-8B under the W8A16 kernel's split-K choice, side by side in one run.
GPU machine, not CI.

    python benchmarks/fp8_step_knobs_gpu.py --out $OUT/fp8_step_knobs_gpu.json

At decode sizes the W8A16 kernel splits K so that its programs fill ``waves`` waves of the multiprocessors
(``triton_splitk.choose_split_k``, 2 by default; the last program of each output tile adds the partial sums). At
one row that is 3 splits for qkv, 5 for o and down, none for gate_up with the 64-wide tiles: more programs hide
the latency of their first loads, fewer pay less for the partial sums and the arrival counters. Isolated GEMM
timings did not predict the step (per-shape tiles that were 4-14% faster alone made the step slower:
results/w8a16_shapes_h100.json), so this times whole steps: ``gpu_engine.time_decode_steps`` (median engine step,
graph replay) at ``--batches`` per setting (``fp8_step_ab.py``: settings alternated, graphs captured afresh, the
bf16 step for the issue-6 ratio, logits against the default's; other splits change the fp32 sum order only).

Result on an H100 (results/fp8_step_knobs_h100.json): 2 waves (the default) fastest, 1 wave x0.982 at batch 1 and
x0.985 at batch 8, 4 waves x0.933 / x0.938.

``balanced`` / ``balanced_gu1``: the split that shares the programs out most evenly over the multiprocessors
(``balanced_split``): 2 waves put 288 qkv programs on 132 multiprocessors (2 or 3 each, so the busiest streams
3 / 2.18 of its share: 73% of the bytes' pace), 320 o and down programs (81%), 448 gate_up programs (85%); 4 splits
(384, 256, 256: 97%) and 2 for gate_up (896: 97%) do better on paper. ``balanced_gu1`` keeps gate_up unsplit.

``o_none`` / ``down_none`` / ``o_down_none``: o_proj and / or down_proj take their 16-bit inputs unquantized
(``unquantized_inputs``): one launch fewer before each (the per-token quantizer; silu_and_mul_fp8's second launch)
for a weight conversion in every program. Other numerics (the logits comparison shows how far).

Result on an H100 (results/fp8_step_knobs_balanced_h100.json, two rounds, against waves2 at 3.57 ms b1 / 3.92-3.97
b8): balanced x0.978 / x0.959, balanced_gu1 x1.004 / x0.997, o_none x1.001 / x0.990, down_none x0.989 / x0.981,
o_down_none x1.000 / x0.98: none beats the default beyond noise, so the split rule and the quantized inputs stay.

``TILE_SETTINGS`` (o_gemv8, qkv_gemv8, attn_gemv8, small_gemv8, o_split2, o_bn32, ...): other W8A16 tiles at one
row for qkv / o / down only (``one_row_tiles``): the CUDA-core GEMV without split K (as the bf16 step's GEMV
runs these shapes), fewer splits or narrower MMA tiles for o. Same products, another fp32 sum order.

Result on an H100 (results/fp8_step_tiles_h100.json, stop 48, two rounds, against waves2 at 3.56 ms b1 / 3.96 b8;
bf16 b1 5.45 ms): o_gemv8 x1.000 / x0.999, o_gemv16 x0.996 / x1.002, qkv_gemv8 x0.999 / x1.000, attn_gemv8
x1.004 / x1.005 (the best: fp8 over bf16 x1.539 against x1.533), small_gemv8 x0.987 / x0.983, o_split2 x0.993 /
x1.001, o_bn32 x0.999 / x0.999. None wins by the 1% a table change needs, so W8A16_TILES keeps one tile for every
shape. The GEMV and 32-wide-MMA settings change the logits of the dummy model (which amplifies any rounding
difference) by a relative L2 of 0.15-0.23, as a change of fp32 sum order does there; o_split2 leaves them equal.
In the step, o and qkv thus cost about the same whichever tile serves them: their in-step rate (1.6-2.0 TB/s in
the stop-47 profile) is set by the short kernel's ramp and tail, not by its tile.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fp8_step_ab import add_step_args, fp8_step_ab_args  # noqa: E402
from specserve.layers import quant_tiles, triton_splitk  # noqa: E402
from specserve.layers.quant_tiles import W8A16_TILES, TileConfig  # noqa: E402

WAVES = {"waves2": 2, "waves1": 1, "waves4": 4}  # the first is the library's default
CHOOSE_SPLIT_K = triton_splitk.choose_split_k  # the library's, whatever is patched in later


def balanced_split(k_tiles: int, num_tiles: int, sms: int, min_tiles_per_split: int = 2,
                   max_per_sm: int = 8) -> int:
    """The split count (dividing ``k_tiles``: equal K ranges) whose programs (``num_tiles x split``, between one and
    ``max_per_sm`` per multiprocessor) share out most evenly: the least ``ceil(programs / sms) / (programs / sms)``,
    the fewest programs among equals. E.g. 96 tiles (qkv at one row) of 32 K tiles on 132 multiprocessors: 4 (384
    programs, 3 a multiprocessor at most for 2.91 on average)."""
    best, best_cost = 1, float("inf")
    for split in range(1, max(1, k_tiles // min_tiles_per_split) + 1):
        programs = num_tiles * split
        if k_tiles % split or (programs < sms and split < k_tiles // min_tiles_per_split):
            continue  # K ranges of unequal length, or less than one program a multiprocessor
        if programs > max_per_sm * sms:
            break
        cost = -(-programs // sms) / (programs / sms)
        if cost < best_cost - 1e-9:
            best, best_cost = split, cost
    return best


@contextlib.contextmanager
def split_choice(choose) -> Iterator[None]:
    """``choose`` (``choose_split_k``'s signature) in place of ``triton_splitk.choose_split_k`` inside the block."""
    triton_splitk.choose_split_k = choose
    try:
        yield
    finally:
        triton_splitk.choose_split_k = CHOOSE_SPLIT_K


def with_waves(waves: int) -> contextlib.AbstractContextManager:
    """The library's split choice asking for ``waves`` waves of programs."""
    return split_choice(lambda config, k_tiles, num_tiles, device, min_tiles_per_split=2: CHOOSE_SPLIT_K(
        config, k_tiles, num_tiles, device, waves=waves, min_tiles_per_split=min_tiles_per_split))


def with_balance(split_gate_up: bool = True) -> contextlib.AbstractContextManager:
    """``balanced_split`` for automatic splits (``split_gate_up`` False: output tiles that already fill the
    multiprocessors stay unsplit)."""
    def choose(config, k_tiles, num_tiles, device, min_tiles_per_split=2):
        if config.split_k > 0:
            return config.split_k
        sms = triton_splitk.num_sms(device)
        if not split_gate_up and num_tiles >= sms:
            return 1
        return balanced_split(k_tiles, num_tiles, sms, min_tiles_per_split)
    return split_choice(choose)


@contextlib.contextmanager
def unquantized_inputs(model: torch.nn.Module, projections: frozenset[str]) -> Iterator[None]:
    """The named projections (``"o"``, ``"down"``) of every layer of ``model`` in ``Fp8Linear``'s activation mode
    "none": they multiply their 16-bit inputs as they are (e4m3 weights converted in registers), so no per-token
    quantizer runs before o_proj, and down's input comes from silu_and_mul's one launch instead of the FP8
    variant's two (``models/llama.fuse_fp8_input`` asks for per-token projections). Other maths than the default
    (activations not rounded to e4m3), so the logits move."""
    modules = [layer.self_attn.o_proj if name == "o" else layer.mlp.down_proj
               for layer in model.layers for name in sorted(projections)]
    saved = [m.activation_quant for m in modules]
    for m in modules:
        m.activation_quant = "none"
    try:
        yield
    finally:
        for m, mode in zip(modules, saved):
            m.activation_quant = mode


def one_row_tiles(tiles: dict[tuple[int, int], TileConfig]) -> contextlib.AbstractContextManager:
    """``W8A16_TILES`` with these weight shapes ``(N, K)`` given their own tile at one row (a batch-1 decode: the
    GEMV path serves up to 4 rows); every other row count and shape as in the table."""
    return quant_tiles.override(W8A16_TILES, by_shape={
        shape: {**W8A16_TILES.by_rows, 1: cfg} for shape, cfg in tiles.items()})


# Llama-3.1-8B's attention-half and down projections (N, K); their W8A16 launches run at 1.7-2.5 TB/s in the
# b1 step against gate_up's 2.8 on an H100 (results/profile_fp8_b1_nopdl_h100.json, by_role).
QKV, O, DOWN = (6144, 4096), (4096, 4096), (4096, 14336)
GEMV8 = TileConfig(8, 512, 4, 1, split_k=1, use_dot=False)  # CUDA-core GEMV, no split K: 512 programs for o
GEMV16 = TileConfig(16, 512, 4, 1, split_k=1, use_dot=False)
TILE_SETTINGS = {
    "o_gemv8": {O: GEMV8}, "o_gemv16": {O: GEMV16}, "qkv_gemv8": {QKV: GEMV8}, "attn_gemv8": {QKV: GEMV8, O: GEMV8},
    "small_gemv8": {QKV: GEMV8, O: GEMV8, DOWN: GEMV8},
    "o_split2": {O: TileConfig(64, 128, 4, 4, split_k=2, fp8_dot=True, prefetch=1)},
    "o_bn32": {O: TileConfig(32, 128, 4, 4, split_k=0, fp8_dot=True, prefetch=1)},
}

# name -> a factory of the setting's context from the FP8 model (fp8_step_ab.py)
SETTINGS = {**{name: (lambda model, waves=waves: with_waves(waves)) for name, waves in WAVES.items()},
            "balanced": lambda model: with_balance(True), "balanced_gu1": lambda model: with_balance(False),
            **{name: functools.partial(unquantized_inputs, projections=frozenset(projs)) for name, projs in
               (("o_none", {"o"}), ("down_none", {"down"}), ("o_down_none", {"o", "down"}))},
            **{name: (lambda model, tiles=tiles: one_row_tiles(tiles)) for name, tiles in TILE_SETTINGS.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  "fp8_step_knobs_gpu.json"))
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="comma-separated names of SETTINGS; the first is the baseline")
    add_step_args(ap)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    rep: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
                 "torch": torch.__version__, "errors": {}}
    t0 = time.perf_counter()
    try:
        fp8_step_ab_args(rep, {name: SETTINGS[name] for name in args.settings.split(",")}, device, args)
    except Exception as exc:  # noqa: BLE001 - keep what was measured
        rep["errors"]["run"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
        print(f"!!! {exc}", flush=True)
    rep["total_seconds"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
