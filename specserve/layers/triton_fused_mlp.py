"""One persistent launch for a decoder layer's whole MLP block at a single decode row, with FP8 weights: the
residual add and RMSNorm, the gate|up projection with SiLU-and-mul, a grid-wide barrier, then the down
projection. Experimental (``benchmarks/persistent_mlp_gpu.py`` times it against the engine's five launches).

Why: at batch 1 a decode step is a chain of ~13 launches per layer, and each boundary costs a few microseconds
of launch, ramp-up and tail on top of streaming the weights (benchmarks/results/fp8_ablate_gpu_h100.json). A
persistent kernel (a fixed grid of programs, all resident, each looping over its share of the work) pays that
once and replaces the boundary between the two projections with a grid-wide barrier. The idea of
whole-model "megakernels" for low-batch decode: Spector et al., "Look Ma, No Bubbles! Designing a Low-Latency
Megakernel for Llama-1B" (Hazy Research, 2025); Cheng et al., Mirage Persistent Kernel (arXiv 2512.22219).

Maths (the engine's FP8 projections, ``quant_gpu.fp8_linear_reference``, with ``act_quant``; else W8A16 on the
16-bit activations, ``w8a16_linear_reference``):

    s   = bf16(x + residual)                        -> written to ``residual_out``
    h   = bf16(bf16(s * rstd(s)) * norm_weight)     (TritonOps.fused_add_rms_norm's roundings)
    g,u = bf16(sum_k q(h)_k * w_gu[n, k] * sh * scale[n])   (fp32 sums; gate rows [0, I), up rows [I, 2 I))
    a   = bf16(bf16(silu(g)) * u)                   (TritonOps.silu_and_mul's roundings)
    out = bf16(sum_k q(a)_k * w_down[n, k] * sa * scale[n])

where ``q(v), sv`` quantize a row per token to e4m3 with triton_w8a16's shared helpers (the fused quantizer's
bits; identity and 1 without ``act_quant``). ``h``'s scale needs the whole row, so every program norms all of
it once; ``a``'s amax is gathered with an atomic max before the barrier, in one of two slots picked by the
launch's parity (the counter's generation, which cannot move before every program has arrived) while program 0
clears the other slot for the next launch. After that barrier the programs quantize ``a`` once between them
(chunks of ``QUANT_BLOCK``, program ``p`` taking chunks ``p, p + P, ...``) into an e4m3 scratch row, and a
second barrier publishes it to the down projection, which then reads e4m3 instead of quantizing every chunk in
every program (the first version did, and spent 16 us of a 83 us block on it on an H100).

Work split. Gate|up: tiles of ``BN1`` output channels, each read as one ``[2 * BN1, BK1]`` weight tile per K
chunk whose rows interleave gate and up (row ``j`` is channel ``j // 2``, gate when ``j`` is even), so the tile's
sums split into matching gate and up halves. Worked example, ``BN1 = 2``, tile 5, ``I = 8``: rows
``[10, 18, 11, 19]`` of the ``[16, K]`` weight -> sums ``[g10, u10, g11, u11]`` -> ``(g, u) = ([g10, g11],
[u10, u11])``. Down: tiles of ``BN2`` rows, K in chunks of ``BK2``. Program ``p`` takes tiles ``p, p + P, p + 2 P,
...`` (``P`` programs) and streams its (tile, chunk) items in order, ``STAGES`` weight tiles in flight through
shared memory (Triton's software pipelining of a ``tl.range`` loop). The barrier is a counter that only grows: a
program adds 1 and waits until the counter reaches the next multiple of ``P`` above its own arrival, so it needs no
reset between launches (int32: 2^31 arrivals). All ``P`` programs must be resident at once: the wrapper checks the
compiled kernel's registers and shared memory against the GPU's limits (``resident_programs_per_sm``) and refuses a
grid that could hang.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.layers.quant_gpu import quantize_fp8_rows
from specserve.layers.triton_pdl import pdl_args
from specserve.layers.triton_w8a16 import _fp8_quantize, _fp8_scale


@triton.jit
def _grid_barrier(counter_ptr, NUM_PROGRAMS: tl.constexpr):
    """Every program's earlier global stores are visible to every program after this returns."""
    tl.debug_barrier()  # this program's threads have all issued their stores
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    target = (arrived // NUM_PROGRAMS + 1) * NUM_PROGRAMS
    seen = arrived + 1
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _gate_up_item(w_ptr, j, pid, row_off, cols, I, H: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
                  NUM_PROGRAMS: tl.constexpr):
    """Pointers ``[2 * BN1, BK1]`` of this program's item ``j`` (tile ``pid + (j // chunks) * P``, chunk
    ``j % chunks``) of the gate|up weight ``[2 I, H]``."""
    chunks: tl.constexpr = H // BK1
    tile = pid + (j // chunks) * NUM_PROGRAMS
    rows = tile * BN1 + row_off  # [2 * BN1]
    return w_ptr + rows.to(tl.int64)[:, None] * H + ((j % chunks) * BK1 + cols)[None, :]


@triton.jit
def _down_item(w_ptr, j, pid, rows0, cols, I: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
               NUM_PROGRAMS: tl.constexpr):
    """Pointers ``[BN2, BK2]`` of this program's item ``j`` of the down weight ``[H, I]``."""
    chunks: tl.constexpr = I // BK2
    tile = pid + (j // chunks) * NUM_PROGRAMS
    rows = tile * BN2 + rows0  # [BN2]
    return w_ptr + rows.to(tl.int64)[:, None] * I + ((j % chunks) * BK2 + cols)[None, :]


@triton.jit
def _fused_mlp_kernel(
    x_ptr,  # [H] bf16: the previous block's output
    res_ptr,  # [H] bf16: the residual stream before x is added
    res_out_ptr,  # [H] bf16: x + residual (written by program 0; not res_ptr: every program reads res_ptr)
    norm_w_ptr,  # [H] bf16 RMSNorm weight
    w_gu_ptr,  # [2 I, H] float8_e4m3fn: gate rows then up rows
    s_gu_ptr,  # [2 I] fp32 per-channel scales
    w_down_ptr,  # [H, I] float8_e4m3fn
    s_down_ptr,  # [H] fp32
    act_ptr,  # [I] bf16 scratch: silu(gate) * up
    act_q_ptr,  # [I] float8_e4m3fn scratch: q(act) (ACT_QUANT only)
    out_ptr,  # [H] bf16: the MLP output
    counter_ptr,  # [1] int32 barrier counter (only grows)
    amax_ptr,  # [2] int32: fp32 bits of the act row's amax, one slot per launch parity (ACT_QUANT only)
    eps,
    I: tl.constexpr, H: tl.constexpr,
    BN1: tl.constexpr, BK1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    QUANT_BLOCK: tl.constexpr,  # act values a program quantizes per step (ACT_QUANT)
    STAGES: tl.constexpr,  # weight tiles in flight per program (Triton's software pipelining of the loads)
    ACT_QUANT: tl.constexpr,  # quantize both projections' activations per token to e4m3 (the engine's FP8 maths)
    USE_PDL: tl.constexpr,  # programmatic dependent launch (triton_pdl); the wait comes before any load
):
    pid = tl.program_id(0)
    chunks1: tl.constexpr = H // BK1
    chunks2: tl.constexpr = I // BK2
    tiles1: tl.constexpr = I // BN1
    tiles2: tl.constexpr = H // BN2
    # items of the programs with the most tiles; a program with one tile fewer masks its last chunks' loads
    # and stores (a masked-off load moves no bytes)
    steps1: tl.constexpr = (tiles1 + NUM_PROGRAMS - 1) // NUM_PROGRAMS * chunks1
    steps2: tl.constexpr = (tiles2 + NUM_PROGRAMS - 1) // NUM_PROGRAMS * chunks2
    n1 = (tiles1 - 1 - pid) // NUM_PROGRAMS * chunks1 + chunks1  # this program's gate|up items
    n2 = (tiles2 - 1 - pid) // NUM_PROGRAMS * chunks2 + chunks2  # ... and down items
    r1 = tl.arange(0, 2 * BN1)
    row_off = r1 // 2 + (r1 % 2) * I  # interleaved gate / up rows of a tile
    c1 = tl.arange(0, BK1)
    r2 = tl.arange(0, BN2)
    c2 = tl.arange(0, BK2)

    if USE_PDL > 0:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    # residual add + the norm's rstd over the whole row (every program; H values from L2)
    hcols = tl.arange(0, H)
    s = (tl.load(x_ptr + hcols).to(tl.float32) + tl.load(res_ptr + hcols).to(tl.float32)).to(tl.bfloat16)
    if pid == 0:
        tl.store(res_out_ptr + hcols, s)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)
    h_scale = 1.0
    # the normed row (its per-token scale needs all of it: every program norms the whole row once)
    h = (sf * rstd).to(tl.bfloat16).to(tl.float32)
    h = (h * tl.load(norm_w_ptr + hcols).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
    if ACT_QUANT:
        h_scale = _fp8_scale(tl.max(tl.abs(h), axis=0))
    if BK1 == H:  # one K chunk per tile: the row's operand once, for all of this program's tiles
        h_row = h
        if ACT_QUANT:
            h_row = _fp8_quantize(h, h_scale).to(tl.float32)
    if ACT_QUANT:
        # this launch's amax slot: the counter's generation does not move before every program has arrived at
        # the barrier, so all programs read the same parity; program 0 clears the other slot for the next launch
        parity = (tl.atomic_add(counter_ptr, 0, sem="relaxed", scope="gpu") // (2 * NUM_PROGRAMS)) % 2  # 2 barriers
        if pid == 0:
            tl.store(amax_ptr + 1 - parity, 0)
    act_amax = tl.zeros((BN1,), dtype=tl.float32)

    acc1 = tl.zeros((2 * BN1,), dtype=tl.float32)
    for j in tl.range(0, steps1, num_stages=STAGES):  # weight tiles pipelined through shared memory
        wa = tl.load(_gate_up_item(w_gu_ptr, j, pid, row_off, c1, I, H, BN1, BK1, NUM_PROGRAMS), mask=j < n1,
                     other=0.0)
        if BK1 == H:
            hk = h_row
        else:  # recomputed per item from L1 / L2: 6 B of activations per weight tile column
            k = (j % chunks1) * BK1 + c1
            hk = (tl.load(x_ptr + k).to(tl.float32) + tl.load(res_ptr + k).to(tl.float32)).to(tl.bfloat16)
            hk = (hk.to(tl.float32) * rstd).to(tl.bfloat16).to(tl.float32)
            hk = (hk * tl.load(norm_w_ptr + k).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
            if ACT_QUANT:
                hk = _fp8_quantize(hk, h_scale).to(tl.float32)  # e4m3 -> fp32 exact: the products are too
        acc1 += tl.sum(wa.to(tl.float32) * hk[None, :], axis=1)
        if j % chunks1 == chunks1 - 1:
            tile = pid + (j // chunks1) * NUM_PROGRAMS
            scale = tl.load(s_gu_ptr + tile * BN1 + row_off, mask=j < n1)
            v = (acc1 * h_scale * scale).to(tl.bfloat16).to(tl.float32)  # fp8_linear_reference's order
            g, u = tl.split(tl.reshape(v, (BN1, 2)))
            silu = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
            a = (silu * u).to(tl.bfloat16)
            tl.store(act_ptr + tile * BN1 + tl.arange(0, BN1), a, mask=j < n1)
            act_amax = tl.maximum(act_amax, tl.where(j < n1, tl.abs(a.to(tl.float32)), 0.0))
            acc1 = tl.zeros((2 * BN1,), dtype=tl.float32)

    if ACT_QUANT:  # non-negative fp32 values order as their int32 bits
        tl.atomic_max(amax_ptr + parity, tl.max(act_amax, axis=0).to(tl.int32, bitcast=True), sem="relaxed",
                      scope="gpu")
    _grid_barrier(counter_ptr, NUM_PROGRAMS)
    a_scale = 1.0
    if ACT_QUANT:
        a_scale = _fp8_scale(tl.atomic_add(amax_ptr + parity, 0, sem="relaxed", scope="gpu").to(tl.float32,
                                                                                                 bitcast=True))
        qc = tl.arange(0, QUANT_BLOCK)
        for c in range(pid, tl.cdiv(I, QUANT_BLOCK), NUM_PROGRAMS):  # q(act) once, shared out among the programs
            offs = c * QUANT_BLOCK + qc
            a = tl.load(act_ptr + offs, mask=offs < I, cache_modifier=".cg").to(tl.float32)
            tl.store(act_q_ptr + offs, _fp8_quantize(a, a_scale), mask=offs < I)
        _grid_barrier(counter_ptr, NUM_PROGRAMS)

    acc2 = tl.zeros((BN2,), dtype=tl.float32)
    for j in tl.range(0, steps2, num_stages=STAGES):
        da = tl.load(_down_item(w_down_ptr, j, pid, r2, c2, I, BN2, BK2, NUM_PROGRAMS), mask=j < n2, other=0.0)
        k = (j % chunks2) * BK2 + c2
        if ACT_QUANT:  # e4m3 -> fp32 exact
            ak = tl.load(act_q_ptr + k, cache_modifier=".cg").to(tl.float32)  # L2: written by other programs
        else:
            ak = tl.load(act_ptr + k, cache_modifier=".cg").to(tl.float32)
        acc2 += tl.sum(da.to(tl.float32) * ak[None, :], axis=1)
        if j % chunks2 == chunks2 - 1:
            rows = (pid + (j // chunks2) * NUM_PROGRAMS) * BN2 + r2
            scale = tl.load(s_down_ptr + rows, mask=j < n2)
            tl.store(out_ptr + rows, (acc2 * a_scale * scale).to(tl.bfloat16), mask=j < n2)
            acc2 = tl.zeros((BN2,), dtype=tl.float32)


def fused_mlp_fp8(
    x: torch.Tensor,  # [1, H] bf16
    residual: torch.Tensor,  # [1, H] bf16
    norm_weight: torch.Tensor,  # [H] bf16
    w_gate_up: torch.Tensor,  # [2 I, H] float8_e4m3fn
    s_gate_up: torch.Tensor,  # [2 I] (or [1, 2 I]) fp32
    w_down: torch.Tensor,  # [H, I] float8_e4m3fn
    s_down: torch.Tensor,  # [H] (or [1, H]) fp32
    eps: float,
    counter: torch.Tensor,  # [1] int32, zeroed once; shared by the launches of one stream and num_programs
    num_programs: int,  # <= the multiprocessors (all must be resident)
    amax: torch.Tensor | None = None,  # [2] int32, zeroed once with counter and kept with it (act_quant)
    act_quant: bool = True,
    residual_out: torch.Tensor | None = None,  # [1, H] bf16 (default: new)
    out: torch.Tensor | None = None,  # [1, H] bf16 (default: new)
    act: torch.Tensor | None = None,  # [I] bf16 scratch (default: new)
    act_q: torch.Tensor | None = None,  # [I] float8_e4m3fn scratch (act_quant; default: new)
    bn1: int = 8, bk1: int = 1024, bn2: int = 16, bk2: int = 1024, num_warps: int = 8, stages: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output [1, H], x + residual [1, H])
    """The MLP block of one decode row in one launch (module docstring). Shapes must tile exactly: ``I % bn1``,
    ``H % bk1``, ``H % bn2``, ``I % bk2`` all 0, and ``H`` and the tile sizes powers of two."""
    h = x.shape[-1]
    i = w_down.shape[1]
    if x.shape != (1, h) or residual.shape != (1, h) or w_gate_up.shape != (2 * i, h) or w_down.shape != (h, i):
        raise ValueError(f"fused_mlp_fp8: shapes x {tuple(x.shape)}, gate_up {tuple(w_gate_up.shape)}, "
                         f"down {tuple(w_down.shape)} do not fit one row of an [{h}] -> [{i}] MLP")
    problem = tiling_problem(h, i, num_programs, bn1, bk1, bn2, bk2)
    if problem:
        raise ValueError(f"fused_mlp_fp8: {problem}")
    residual_out = torch.empty_like(residual) if residual_out is None else residual_out
    out = torch.empty_like(x) if out is None else out
    act = torch.empty(i, dtype=x.dtype, device=x.device) if act is None else act
    if act_q is None:
        act_q = torch.empty(i if act_quant else 1, dtype=torch.float8_e4m3fn, device=x.device)
    if act_quant and amax is None:
        raise ValueError("fused_mlp_fp8: act_quant needs the amax buffer kept with the counter")
    args = (x, residual, residual_out, norm_weight, w_gate_up, s_gate_up.reshape(-1), w_down, s_down.reshape(-1),
            act, act_q, out, counter, counter if amax is None else amax, eps)
    kwargs = dict(I=i, H=h, BN1=bn1, BK1=bk1, BN2=bn2, BK2=bk2, NUM_PROGRAMS=num_programs, QUANT_BLOCK=256,
                  STAGES=stages, ACT_QUANT=act_quant, num_warps=num_warps, **pdl_args(x.device))
    if x.is_cuda:  # the grid barrier needs every program resident at once: refuse a launch that could hang
        compiled = _fused_mlp_kernel.warmup(*args, grid=(num_programs,), **kwargs)
        compiled._init_handles()  # loads the binary, which sets n_regs (Triton 3.6 fills it in lazily)
        props = torch.cuda.get_device_properties(x.device)
        per_sm = resident_programs_per_sm(compiled.n_regs, num_warps, compiled.metadata.shared,
                                          props.shared_memory_per_multiprocessor)
        if num_programs > per_sm * props.multi_processor_count:
            raise ValueError(f"fused_mlp_fp8: {num_programs} programs but only {per_sm} per multiprocessor fit "
                             f"({compiled.n_regs} registers, {compiled.metadata.shared} B shared each)")
    _fused_mlp_kernel[(num_programs,)](*args, **kwargs)
    return out, residual_out


def tiling_problem(hidden: int, inter: int, num_programs: int, bn1: int, bk1: int, bn2: int, bk2: int) -> str | None:
    """Why an ``[hidden] -> [inter]`` MLP cannot run with these tiles and programs, or None: tiles must divide
    exactly, ``hidden`` and the tile sizes be powers of two, and every program own at least one tile of each
    projection (e.g. SmolLM2's hidden 576 is not a power of two)."""
    if inter % bn1 or hidden % bk1 or hidden % bn2 or inter % bk2 or any(
            v <= 0 or v & (v - 1) for v in (hidden, bn1, bk1, bn2, bk2)):
        return f"H={hidden}, I={inter} do not tile by ({bn1}, {bk1}, {bn2}, {bk2})"
    if num_programs > min(inter // bn1, hidden // bn2):
        return f"{num_programs} programs for {min(inter // bn1, hidden // bn2)} tiles"
    return None


def resident_programs_per_sm(regs_per_thread: int, num_warps: int, shared_bytes: int, sm_shared_bytes: int,
                             sm_regs: int = 65536, sm_warps: int = 64, sm_programs: int = 32) -> int:
    """Programs of a kernel that fit on one multiprocessor at once (Hopper limits by default): registers are
    allocated per warp in units of 256, shared memory per program with 1 KiB reserved by the runtime.
    E.g. 128 registers, 8 warps, 2 KiB shared: 65536 // (8 * 4096) = 2."""
    per_warp = -(-regs_per_thread * 32 // 256) * 256
    by_regs = sm_regs // (per_warp * num_warps)
    by_shared = sm_shared_bytes // (shared_bytes + 1024)
    return max(0, min(by_regs, sm_warps // num_warps, by_shared, sm_programs))


def fused_mlp_reference(
    x: torch.Tensor,  # [1, H] bf16
    residual: torch.Tensor,  # [1, H] bf16
    norm_weight: torch.Tensor,  # [H] bf16
    w_gate_up: torch.Tensor,  # [2 I, H] float8_e4m3fn
    s_gate_up: torch.Tensor,  # [2 I] fp32
    w_down: torch.Tensor,  # [H, I] float8_e4m3fn
    s_down: torch.Tensor,  # [H] fp32
    eps: float,
    act_quant: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output [1, H], x + residual [1, H])
    """The module docstring's maths in torch (float64 sums: the oracle for the kernel's fp32 ones; each 16-bit
    rounding as the kernel does it, so outputs differ only where the sum order moves a value across a rounding
    boundary)."""
    s = (x.float() + residual.float()).to(x.dtype)
    sf = s.float()
    rstd = torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    h = ((sf * rstd).to(x.dtype).float() * norm_weight.float()).to(x.dtype)

    def linear(v: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
        if not act_quant:
            return (v.double() @ w.double().T * w_scale.reshape(1, -1).double()).to(x.dtype)
        v_q, v_scale = quantize_fp8_rows(v)
        return (v_q.double() @ w.double().T * v_scale.double() * w_scale.reshape(1, -1).double()).to(x.dtype)

    gu = linear(h, w_gate_up, s_gate_up).float()
    i = w_down.shape[1]
    g, u = gu[:, :i], gu[:, i:]
    a = ((g / (1.0 + torch.exp(-g))).to(x.dtype).float() * u).to(x.dtype)
    return linear(a, w_down, s_down), s
