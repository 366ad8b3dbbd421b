"""The persistent FP8 MLP kernel (``layers/triton_fused_mlp.py``) against ``fused_mlp_reference``.

Without a GPU the kernel runs under Triton's interpreter, one program at a time, so only one program can take
part in the grid barrier (it then passes at once); the multi-program barrier and the timing run on the GPU
(``benchmarks/persistent_mlp_gpu.py``, which also checks every tiling it times against the same reference).
Tilings here cover several tiles per program, several K chunks per tile, the two-items-ahead prefetch running
past the program's last item, and programs with fewer tiles than others (masked tail items).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
from specserve.layers import triton_fused_mlp, triton_w8a16  # noqa: E402
from specserve.layers.quant_gpu import quantize_fp8_rows  # noqa: E402
from tests.triton_interpreter import fix_interpreter, reload_interpreted_chain  # noqa: E402

if DEVICE.type == "cpu":  # the kernel calls triton_w8a16's quantizer helpers: those must be interpreted too
    _, triton_fused_mlp = reload_interpreted_chain((triton_w8a16, "_w8a16_kernel"),
                                                   (triton_fused_mlp, "_fused_mlp_kernel"))
    fix_interpreter()

TILINGS = [  # (bn1, bk1, bn2, bk2)
    (8, 32, 16, 32),
    (4, 64, 8, 32),  # bk1 = H (64): one K chunk spans the row, the normed row made once per program
    (2, 16, 4, 16),
    (16, 64, 32, 32),
]


def case(hidden: int, inter: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, hidden, generator=gen).to(torch.bfloat16)
    res = (3 * torch.randn(1, hidden, generator=gen)).to(torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)
    w_gu, s_gu = quantize_fp8_rows(torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5)
    w_d, s_d = quantize_fp8_rows(torch.randn(hidden, inter, generator=gen) / inter**0.5)
    return [t.to(DEVICE) for t in (x, res, norm, w_gu, s_gu.reshape(-1), w_d, s_d.reshape(-1))]


def run(args, tiling, programs=1, warps=4, act_quant=True, state=None):
    """One launch; ``state`` = (counter, amax) kept across launches (fresh zeros by default)."""
    bn1, bk1, bn2, bk2 = tiling
    counter, amax = state or (torch.zeros(1, dtype=torch.int32, device=DEVICE),
                              torch.zeros(2, dtype=torch.int32, device=DEVICE))
    out, res_out = triton_fused_mlp.fused_mlp_fp8(*args, 1e-5, counter, programs, amax=amax, act_quant=act_quant,
                                                  bn1=bn1, bk1=bk1, bn2=bn2, bk2=bk2, num_warps=warps)
    return out, res_out, int(counter.item())


def assert_close_to(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The fp32 sums may round a gate / up / act value (or, quantized, its e4m3 code) the other way than the
    fp64 reference: a few ulps of an output at most, and most outputs the same bits."""
    diff = (out.double() - ref.double()).abs()
    ulp = torch.finfo(torch.bfloat16).eps * ref.double().abs()
    assert bool((diff <= 4 * ulp + 2e-3 * ref.double().abs().max()).all()), diff.max().item()
    assert (out != ref).sum().item() <= out.numel() // 8


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), tiling=st.sampled_from(TILINGS), act_quant=st.booleans())
def test_kernel_equals_reference(seed: int, tiling, act_quant: bool) -> None:
    args = case(64, 96, seed)
    ref, ref_res = triton_fused_mlp.fused_mlp_reference(*args, 1e-5, act_quant=act_quant)
    out, res_out, arrivals = run(args, tiling, act_quant=act_quant)
    assert torch.equal(res_out, ref_res)  # bf16(x + residual), one rounding
    assert arrivals == (2 if act_quant else 1)  # one program; a barrier before the down projection (and before q(act))
    assert_close_to(out, ref)


def test_successive_launches_keep_their_own_amax() -> None:
    """Launches sharing a counter alternate amax slots, each cleared by the launch before: a launch whose act
    row has a small amax after one with a large amax still gets its own scale (a stale slot would give it the
    larger one and flush its small values to zero)."""
    big, small = case(64, 96, 3), case(64, 96, 4)
    small[4] = small[4] * 1e-3  # the second case's act row much smaller, through its gate|up scales
    state = (torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE))
    for args in (big, big, small, small):  # the third launch reuses the first one's slot
        ref, _ = triton_fused_mlp.fused_mlp_reference(*args, 1e-5)
        out, _, _ = run(args, TILINGS[0], state=state)
        assert_close_to(out, ref)
    assert int(state[0].item()) == 8  # two barriers a launch


def test_wrong_interleave_or_scale_is_caught() -> None:
    """The oracle is sharp: swapping the gate and up halves of the weight changes the output far beyond the
    tolerance above (what a wrong row interleave in the kernel would do)."""
    args = case(64, 96, 0)
    ref, _ = triton_fused_mlp.fused_mlp_reference(*args, 1e-5)
    x, res, norm, w_gu, s_gu, w_d, s_d = args
    swapped = [x, res, norm, torch.cat([w_gu[96:], w_gu[:96]]), torch.cat([s_gu[96:], s_gu[:96]]), w_d, s_d]
    out, _, _ = run(swapped, TILINGS[0])
    assert (out.double() - ref.double()).abs().max().item() > 0.05 * ref.double().abs().max().item()
    with pytest.raises(AssertionError):
        assert_close_to(out, ref)


@pytest.mark.parametrize("bad", ["rows", "tiles", "programs"])
def test_shape_errors_name_the_problem(bad: str) -> None:
    args = case(64, 96, 1)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    if bad == "rows":
        args[0] = torch.cat([args[0], args[0]])
        match = "shapes"
        kwargs, programs = {}, 1
    elif bad == "tiles":
        match, kwargs, programs = "tile", dict(bn1=6, bk1=32, bn2=16, bk2=32), 1
    else:
        match, kwargs, programs = "programs", dict(bn1=8, bk1=32, bn2=16, bk2=32), 5
    with pytest.raises(ValueError, match=match):
        triton_fused_mlp.fused_mlp_fp8(*args, 1e-5, counter, programs, act_quant=False, **kwargs)
    with pytest.raises(ValueError, match="amax"):
        triton_fused_mlp.fused_mlp_fp8(*case(64, 96, 1), 1e-5, counter, 1, bn1=8, bk1=32, bn2=16, bk2=32)


@pytest.mark.parametrize("regs,warps,shared,expected", [
    (128, 8, 2048, 2),  # registers: 65536 // (8 warps x 128 x 32)
    (104, 8, 67712, 2),  # 104 x 32 = 3328 registers a warp (a multiple of 256): 65536 // 26624 = 2
    (72, 4, 56352, 4),  # shared memory: 233472 // (56352 + 1024) = 4 (registers would allow 7)
    (32, 1, 0, 32),  # the cap on programs per multiprocessor
    (255, 16, 0, 0),  # 16 warps of 255 registers do not fit at all
])
def test_resident_programs_per_sm(regs: int, warps: int, shared: int, expected: int) -> None:
    assert triton_fused_mlp.resident_programs_per_sm(regs, warps, shared, 233472) == expected
