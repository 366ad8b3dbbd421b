"""The persistent FP8 MLP block of ``layers/triton_fused_mlp.py`` with its products on the tensor cores: e4m3 x
e4m3 MMAs on 64-row weight tiles (Hopper's wgmma; Triton lowers narrower fp8 tiles to fp16 MMAs behind a
conversion of every weight, the throughput limit of the FMA kernel too), and the work shared out stream-K so that
every program streams the same number of weight bytes. Experimental, behind ``quant_tiles.FUSED_MLP_ONE_ROW``
(``"mma": True``); ``benchmarks/persistent_mlp_gpu.py`` times it against the engine's five launches.

Stream-K (Osama et al., "Stream-K: Work-centric Parallel Decomposition for Dense Matrix-Matrix Multiplication
on GPU", PPoPP 2023): a projection's work is its tiles' K chunks in a row, tile after tile, ``W = tiles x
chunks``; program ``p`` of ``P`` takes chunks ``[p W // P, (p + 1) W // P)``. 64-row tiles give too few tiles to
share out whole (gate|up: 448 tiles over 132 programs is 3.4 each, so the slowest program would stream 4 and the
block would run at 85% of the bytes' pace), chunks do not. A tile that lies inside one program's range is
finished by it; a tile cut by range boundaries has ``n`` contributors (programs ``p0 .. p1``), each storing its
partial sums in slot ``p - p0`` of the tile and counting its arrival; the last to arrive adds the slots in slot
order (so the sums do not depend on who came last), finishes the tile and zeroes its counter for the next launch.
Worked example, 3 tiles of ``CH = 4`` chunks (``W = 12``), ``P = 5``: ranges ``[0, 2), [2, 4), [4, 7), [7, 9),
[9, 12)``; tile 0 (chunks 0-3) = programs 0 and 1 (``p0 = 0``, ``n = 2``), tile 1 (4-7) = program 2 (4-6) and 3
(7), tile 2 (8-11) = program 3 (8) and 4 (9-11). The program owning chunk ``c`` is ``((c + 1) P - 1) // W``.

Maths and phases as ``triton_fused_mlp`` (its docstring; ``fused_mlp_reference`` is the oracle): every program
norms and quantizes the row ``h`` (its own copy, column 0 of the MMA's 16-wide activation operand; the other 15
columns are masked loads that move no bytes), gate|up tiles interleave gate and up rows so a finished tile yields
``a = silu(g) * u`` for its 32 channels, the act row's amax is gathered with an atomic max, a grid barrier, ``q(a)``
made once among the programs, a second barrier, then the down projection. The fp8 MMA keeps fewer bits than fp32
in its running sum over each 32 products (``triton_w8a16``'s docstring), as the engine's W8A16 kernel does.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from specserve.layers.triton_fused_mlp import _grid_barrier, resident_programs_per_sm
from specserve.layers.triton_pdl import pdl_args
from specserve.layers.triton_w8a16 import FP8_PRECISE_EVERY, _fp8_quantize, _fp8_scale

MMA_ROWS = 64  # weight rows of a tile on the MMA's M side: Hopper's fp8 wgmma takes 64


@triton.jit
def _share_tile(
    v,  # [R] fp32: this program's partial sums of a tile cut by range boundaries
    tile,
    slots_ptr,  # [tiles, NMAX, R] fp32 partial sums
    cnt_ptr,  # [tiles] int32 arrival counters, zero before and after a launch
    pid, rows,
    CH: tl.constexpr, W: tl.constexpr, P: tl.constexpr, NMAX: tl.constexpr, R: tl.constexpr,
):
    """``(total, done)``: the tile's full sums and True for the last of its contributors to arrive; else this
    program's partial and False (it must not store). Called after the main loop: atomics and barriers inside it
    would stop Triton pipelining the loop's loads."""
    p0 = ((tile * CH + 1) * P - 1) // W
    n = ((tile + 1) * CH * P - 1) // W - p0 + 1
    base = slots_ptr + tile * (NMAX * R)
    tl.store(base + (pid - p0) * R + rows, v)
    tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    done = arrived == n - 1
    total = v
    if done:
        total = tl.load(base + rows, cache_modifier=".cg")
        for s in range(1, n):
            total += tl.load(base + s * R + rows, cache_modifier=".cg")
        tl.store(cnt_ptr + tile, 0)
    return total, done


@triton.jit
def _gate_up_tile_done(total, tile, s_gu_ptr, act_ptr, h_scale, row_off, BN1: tl.constexpr):
    """A finished gate|up tile: ``a = silu(g) * u`` for its BN1 channels stored; returns max |a|."""
    scale = tl.load(s_gu_ptr + tile * BN1 + row_off)
    v = (total * h_scale * scale).to(tl.bfloat16).to(tl.float32)  # fp8_linear_reference's order
    g, u = tl.split(tl.reshape(v, (BN1, 2)))
    silu = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
    a = (silu * u).to(tl.bfloat16)
    tl.store(act_ptr + tile * BN1 + tl.arange(0, BN1), a)
    return tl.max(tl.abs(a.to(tl.float32)), axis=0)


@triton.jit
def _down_tile_done(total, tile, s_down_ptr, out_ptr, a_scale, r2, BN2: tl.constexpr):
    """A finished down tile: its BN2 outputs stored."""
    rows = tile * BN2 + r2
    tl.store(out_ptr + rows, (total * a_scale * tl.load(s_down_ptr + rows)).to(tl.bfloat16))


@triton.jit
def _streamk_mlp_kernel(
    x_ptr,  # [H] bf16: the previous block's output
    res_ptr,  # [H] bf16: the residual stream before x is added
    res_out_ptr,  # [H] bf16: x + residual (written by program 0)
    norm_w_ptr,  # [H] bf16 RMSNorm weight
    w_gu_ptr,  # [2 I, H] float8_e4m3fn: gate rows then up rows
    s_gu_ptr,  # [2 I] fp32 per-channel scales
    w_down_ptr,  # [H, I] float8_e4m3fn
    s_down_ptr,  # [H] fp32
    act_ptr,  # [I] bf16 scratch: silu(gate) * up
    act_q_ptr,  # [I] float8_e4m3fn scratch: q(act)
    hq_ptr,  # [P, H] float8_e4m3fn scratch: each program's copy of q(h)
    out_ptr,  # [H] bf16: the MLP output
    counter_ptr,  # [1] int32 barrier counter (only grows)
    amax_ptr,  # [2] int32: fp32 bits of the act row's amax, one slot per launch parity
    slots1_ptr,  # [I / BN1, NMAX1, 2 BN1] fp32 gate|up partial sums of cut tiles
    cnt1_ptr,  # [I / BN1] int32 arrival counters
    slots2_ptr,  # [H / BN2, NMAX2, BN2] fp32 down partial sums
    cnt2_ptr,  # [H / BN2] int32
    eps,
    I: tl.constexpr, H: tl.constexpr,
    BN1: tl.constexpr, BK1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
    P: tl.constexpr,  # programs (all resident)
    NMAX1: tl.constexpr, NMAX2: tl.constexpr,  # most contributors of one tile
    QUANT_BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl); the wait comes before any load
    PF2: tl.constexpr = 0,  # down chunks per program asked into L2 before the barriers (0: none; module docstring)
):
    pid = tl.program_id(0)
    CH1: tl.constexpr = H // BK1
    CH2: tl.constexpr = I // BK2
    W1: tl.constexpr = (I // BN1) * CH1
    W2: tl.constexpr = (H // BN2) * CH2
    r1 = tl.arange(0, 2 * BN1)
    row_off = r1 // 2 + (r1 % 2) * I  # interleaved gate / up rows of a tile
    c1 = tl.arange(0, BK1)
    r2 = tl.arange(0, BN2)
    c2 = tl.arange(0, BK2)
    mc = tl.arange(0, 16)  # the activation operand's columns: the row is column 0
    col0 = (mc == 0)[None, :]  # [1, 16]

    if USE_PDL > 0:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    # residual add, RMSNorm and q(h) over the whole row (every program, from L2)
    hcols = tl.arange(0, H)
    s = (tl.load(x_ptr + hcols).to(tl.float32) + tl.load(res_ptr + hcols).to(tl.float32)).to(tl.bfloat16)
    if pid == 0:
        tl.store(res_out_ptr + hcols, s)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)
    h = (sf * rstd).to(tl.bfloat16).to(tl.float32)
    h = (h * tl.load(norm_w_ptr + hcols).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
    h_scale = _fp8_scale(tl.max(tl.abs(h), axis=0))
    hq_row = hq_ptr + pid * H
    tl.store(hq_row + hcols, _fp8_quantize(h, h_scale))
    tl.debug_barrier()  # the program's threads see each other's stores
    # this launch's amax slot (triton_fused_mlp: the barrier counter's generation; two barriers a launch)
    parity = (tl.atomic_add(counter_ptr, 0, sem="relaxed", scope="gpu") // (2 * P)) % 2
    if pid == 0:
        tl.store(amax_ptr + 1 - parity, 0)

    # gate|up: chunks [lo, hi) of W1, tile after tile
    lo = pid * W1 // P
    hi = (pid + 1) * W1 // P
    act_amax = 0.0
    acc = tl.zeros((2 * BN1, 16), dtype=tl.float32)  # out.T = W @ [q(h), 0, ..., 0].T
    part_a = tl.zeros((2 * BN1,), dtype=tl.float32)  # the partial of the first tile, cut at its start
    part_b = tl.zeros((2 * BN1,), dtype=tl.float32)  # ... of the last, cut at its end only
    for c in tl.range(lo, hi, num_stages=STAGES):
        tile = c // CH1
        k = (c % CH1) * BK1 + c1
        w = tl.load(w_gu_ptr + (tile * BN1 + row_off).to(tl.int64)[:, None] * H + k[None, :])  # [2 BN1, BK1]
        xt = tl.load(hq_row + k[:, None] + mc[None, :] * 0, mask=col0, other=0.0)  # [BK1, 16]
        acc = tl.dot(w, xt, acc, max_num_imprecise_acc=FP8_PRECISE_EVERY)
        if (c % CH1 == CH1 - 1) | (c == hi - 1):
            v = tl.sum(tl.where(col0, acc, 0.0), axis=1)
            if (tile * CH1 >= lo) & (tile * CH1 + CH1 <= hi):  # the whole tile is this program's
                act_amax = tl.maximum(act_amax, _gate_up_tile_done(v, tile, s_gu_ptr, act_ptr, h_scale, row_off,
                                                                   BN1))
            part_a = tl.where(tile * CH1 < lo, v, part_a)
            part_b = tl.where((tile * CH1 >= lo) & (tile * CH1 + CH1 > hi), v, part_b)
            acc = tl.zeros((2 * BN1, 16), dtype=tl.float32)
    if PF2 > 0:  # this program's first down chunks, 128-byte lines, while the other programs finish gate|up
        LINES: tl.constexpr = BK2 // 128
        ln = tl.arange(0, BN2 * LINES)
        lo2 = pid * W2 // P
        for c in range(lo2, tl.minimum(lo2 + PF2, (pid + 1) * W2 // P)):
            addr = (w_down_ptr + ((c // CH2) * BN2 + ln // LINES).to(tl.int64) * I + (c % CH2) * BK2
                    + (ln % LINES) * 128)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32,
                                      is_pure=False, pack=1)
    first, last = lo // CH1, (hi - 1) // CH1
    if first * CH1 < lo:
        total, done = _share_tile(part_a, first, slots1_ptr, cnt1_ptr, pid, r1, CH1, W1, P, NMAX1, 2 * BN1)
        if done:
            act_amax = tl.maximum(act_amax, _gate_up_tile_done(total, first, s_gu_ptr, act_ptr, h_scale, row_off,
                                                               BN1))
    if (last * CH1 + CH1 > hi) & ((last != first) | (first * CH1 >= lo)):
        total, done = _share_tile(part_b, last, slots1_ptr, cnt1_ptr, pid, r1, CH1, W1, P, NMAX1, 2 * BN1)
        if done:
            act_amax = tl.maximum(act_amax, _gate_up_tile_done(total, last, s_gu_ptr, act_ptr, h_scale, row_off,
                                                               BN1))

    # non-negative fp32 values order as their int32 bits
    tl.atomic_max(amax_ptr + parity, act_amax.to(tl.int32, bitcast=True), sem="relaxed", scope="gpu")
    _grid_barrier(counter_ptr, P)
    a_scale = _fp8_scale(tl.atomic_add(amax_ptr + parity, 0, sem="relaxed", scope="gpu").to(tl.float32,
                                                                                             bitcast=True))
    qc = tl.arange(0, QUANT_BLOCK)
    for b in range(pid, tl.cdiv(I, QUANT_BLOCK), P):  # q(act) once, shared out among the programs
        offs = b * QUANT_BLOCK + qc
        a = tl.load(act_ptr + offs, mask=offs < I, cache_modifier=".cg").to(tl.float32)
        tl.store(act_q_ptr + offs, _fp8_quantize(a, a_scale), mask=offs < I)
    _grid_barrier(counter_ptr, P)

    # down: chunks [lo, hi) of W2
    lo = pid * W2 // P
    hi = (pid + 1) * W2 // P
    acc2 = tl.zeros((BN2, 16), dtype=tl.float32)
    part_a2 = tl.zeros((BN2,), dtype=tl.float32)
    part_b2 = tl.zeros((BN2,), dtype=tl.float32)
    for c in tl.range(lo, hi, num_stages=STAGES):
        tile = c // CH2
        k = (c % CH2) * BK2 + c2
        w = tl.load(w_down_ptr + (tile * BN2 + r2).to(tl.int64)[:, None] * I + k[None, :])  # [BN2, BK2]
        at = tl.load(act_q_ptr + k[:, None] + mc[None, :] * 0, mask=col0, other=0.0, cache_modifier=".cg")
        acc2 = tl.dot(w, at, acc2, max_num_imprecise_acc=FP8_PRECISE_EVERY)
        if (c % CH2 == CH2 - 1) | (c == hi - 1):
            v = tl.sum(tl.where(col0, acc2, 0.0), axis=1)
            if (tile * CH2 >= lo) & (tile * CH2 + CH2 <= hi):
                _down_tile_done(v, tile, s_down_ptr, out_ptr, a_scale, r2, BN2)
            part_a2 = tl.where(tile * CH2 < lo, v, part_a2)
            part_b2 = tl.where((tile * CH2 >= lo) & (tile * CH2 + CH2 > hi), v, part_b2)
            acc2 = tl.zeros((BN2, 16), dtype=tl.float32)
    first, last = lo // CH2, (hi - 1) // CH2
    if first * CH2 < lo:
        total, done = _share_tile(part_a2, first, slots2_ptr, cnt2_ptr, pid, r2, CH2, W2, P, NMAX2, BN2)
        if done:
            _down_tile_done(total, first, s_down_ptr, out_ptr, a_scale, r2, BN2)
    if (last * CH2 + CH2 > hi) & ((last != first) | (first * CH2 >= lo)):
        total, done = _share_tile(part_b2, last, slots2_ptr, cnt2_ptr, pid, r2, CH2, W2, P, NMAX2, BN2)
        if done:
            _down_tile_done(total, last, s_down_ptr, out_ptr, a_scale, r2, BN2)


def max_contributors(tiles: int, chunks: int, programs: int) -> int:
    """Most programs whose chunk ranges (``[p W // P, (p + 1) W // P)``, ``W = tiles x chunks``) meet one tile.
    E.g. 64 tiles of 112 chunks over 132 programs (54 or 55 chunks each): 4 (a tile may take one program's last
    chunk, two whole ranges and the next one's first chunks)."""
    w = tiles * chunks
    owner = lambda c: ((c + 1) * programs - 1) // w  # noqa: E731
    return max(owner(t * chunks + chunks - 1) - owner(t * chunks) + 1 for t in range(tiles))


@dataclasses.dataclass
class StreamKBuffers:
    """What one stream of launches shares (all zeroed or scratch; counters only grow or return to zero):
    the barrier ``counter`` [1] and ``amax`` slots [2] int32, the per-tile arrival counters ``cnt1`` / ``cnt2``,
    the partial-sum ``slots1`` / ``slots2`` (fp32), and the scratch rows ``hq`` [P, H] and ``act`` / ``act_q``."""

    counter: torch.Tensor
    amax: torch.Tensor
    cnt1: torch.Tensor
    cnt2: torch.Tensor
    slots1: torch.Tensor
    slots2: torch.Tensor
    hq: torch.Tensor
    act: torch.Tensor
    act_q: torch.Tensor
    nmax1: int
    nmax2: int

    @classmethod
    def make(cls, hidden: int, inter: int, programs: int, bn1: int, bk1: int, bn2: int, bk2: int,
             device: torch.device, dtype: torch.dtype = torch.bfloat16) -> StreamKBuffers:
        t1, t2 = inter // bn1, hidden // bn2
        n1 = max_contributors(t1, hidden // bk1, programs)
        n2 = max_contributors(t2, inter // bk2, programs)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(torch.zeros(1, **i32), torch.zeros(2, **i32), torch.zeros(t1, **i32), torch.zeros(t2, **i32),
                   torch.empty(t1 * n1 * 2 * bn1, dtype=torch.float32, device=device),
                   torch.empty(t2 * n2 * bn2, dtype=torch.float32, device=device),
                   torch.empty(programs, hidden, dtype=torch.float8_e4m3fn, device=device),
                   torch.empty(inter, dtype=dtype, device=device),
                   torch.empty(inter, dtype=torch.float8_e4m3fn, device=device), n1, n2)


def tiling_problem(hidden: int, inter: int, programs: int, bn1: int, bk1: int, bn2: int, bk2: int) -> str | None:
    """Why an ``[hidden] -> [inter]`` MLP cannot run with these tiles, or None: 64-row MMA tiles (``2 bn1`` and
    ``bn2``), K chunks that divide the rows (powers of two, at least 32: an fp8 MMA's K step), ``hidden`` a
    power of two, and at least one chunk of each projection per program."""
    if 2 * bn1 != MMA_ROWS or bn2 != MMA_ROWS:
        return f"tiles of {2 * bn1} and {bn2} weight rows (the fp8 MMA takes {MMA_ROWS})"
    if inter % bn1 or hidden % bn2 or hidden % bk1 or inter % bk2 or any(
            v < 32 or v & (v - 1) for v in (hidden, bk1, bk2)):
        return f"H={hidden}, I={inter} do not tile by ({bn1}, {bk1}, {bn2}, {bk2})"
    if programs > min(inter // bn1 * (hidden // bk1), hidden // bn2 * (inter // bk2)):
        return f"{programs} programs for fewer chunks"
    return None


def streamk_mlp_fp8(
    x: torch.Tensor,  # [1, H] bf16
    residual: torch.Tensor,  # [1, H] bf16
    norm_weight: torch.Tensor,  # [H] bf16
    w_gate_up: torch.Tensor,  # [2 I, H] float8_e4m3fn
    s_gate_up: torch.Tensor,  # [2 I] (or [2 I, 1]) fp32
    w_down: torch.Tensor,  # [H, I] float8_e4m3fn
    s_down: torch.Tensor,  # [H] (or [H, 1]) fp32
    eps: float,
    buffers: StreamKBuffers,  # made once for these shapes, programs and tiles (StreamKBuffers.make)
    num_programs: int,  # <= the multiprocessors x programs resident on each
    residual_out: torch.Tensor | None = None,  # [1, H] bf16 (default: new)
    out: torch.Tensor | None = None,  # [1, H] bf16 (default: new)
    bn1: int = 32, bk1: int = 128, bn2: int = 64, bk2: int = 128, num_warps: int = 4, stages: int = 4,
    prefetch_kib: int = 0,  # KiB of each program's first down chunks asked into L2 before the barriers (GPU)
) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output [1, H], x + residual [1, H])
    """The MLP block of one decode row in one launch on the tensor cores (module docstring); activations
    quantized per token to e4m3 as the engine's ``Fp8Linear`` does."""
    h = x.shape[-1]
    i = w_down.shape[1]
    if x.shape != (1, h) or residual.shape != (1, h) or w_gate_up.shape != (2 * i, h) or w_down.shape != (h, i):
        raise ValueError(f"streamk_mlp_fp8: shapes x {tuple(x.shape)}, gate_up {tuple(w_gate_up.shape)}, "
                         f"down {tuple(w_down.shape)} do not fit one row of an [{h}] -> [{i}] MLP")
    problem = tiling_problem(h, i, num_programs, bn1, bk1, bn2, bk2)
    if problem:
        raise ValueError(f"streamk_mlp_fp8: {problem}")
    b = buffers
    if b.hq.shape != (num_programs, h) or b.cnt1.numel() != i // bn1 or b.cnt2.numel() != h // bn2:
        raise ValueError("streamk_mlp_fp8: buffers were made for other shapes, programs or tiles")
    residual_out = torch.empty_like(residual) if residual_out is None else residual_out
    out = torch.empty_like(x) if out is None else out
    args = (x, residual, residual_out, norm_weight, w_gate_up, s_gate_up.reshape(-1), w_down, s_down.reshape(-1),
            b.act, b.act_q, b.hq, out, b.counter, b.amax, b.slots1, b.cnt1, b.slots2, b.cnt2, eps)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter runs no PTX
    pf2 = prefetch_kib * 1024 // (bn2 * bk2) if not interpreted and bk2 % 128 == 0 else 0
    kwargs = dict(I=i, H=h, BN1=bn1, BK1=bk1, BN2=bn2, BK2=bk2, P=num_programs, NMAX1=b.nmax1, NMAX2=b.nmax2,
                  QUANT_BLOCK=256, STAGES=stages, PF2=pf2, num_warps=num_warps, **pdl_args(x.device))
    if x.is_cuda:  # the grid barrier needs every program resident at once: refuse a launch that could hang
        compiled = _streamk_mlp_kernel.warmup(*args, grid=(num_programs,), **kwargs)
        compiled._init_handles()  # sets n_regs (Triton 3.6 fills it in lazily)
        props = torch.cuda.get_device_properties(x.device)
        per_sm = resident_programs_per_sm(compiled.n_regs, num_warps, compiled.metadata.shared,
                                          props.shared_memory_per_multiprocessor)
        if num_programs > per_sm * props.multi_processor_count:
            raise ValueError(f"streamk_mlp_fp8: {num_programs} programs but only {per_sm} per multiprocessor fit "
                             f"({compiled.n_regs} registers, {compiled.metadata.shared} B shared each)")
    _streamk_mlp_kernel[(num_programs,)](*args, **kwargs)
    return out, residual_out
