"""The tensor-core persistent FP8 MLP kernel (``layers/triton_streamk_mlp.py``) against ``fused_mlp_reference``,
and its stream-K work split.

Without a GPU the kernel runs under Triton's interpreter one program at a time, so only a one-program grid can
pass its barriers: every tile is then whole. Tiles cut between programs (partial sums in slots, the last arrival
adds them) run on the GPU, where ``benchmarks/persistent_mlp_gpu.py`` checks every tiling it times against the
same reference, three launches in a row (the arrival counters must return to zero). The split itself (which
program owns which chunks, how many programs meet a tile, the slot each takes) is checked here against a
brute-force count, with the very formulas the kernel uses.
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
from specserve.layers import triton_fused_mlp, triton_streamk_mlp, triton_w8a16  # noqa: E402
from tests.triton_interpreter import fix_interpreter, reload_interpreted_chain  # noqa: E402
from tests.unit.test_triton_fused_mlp import assert_close_to, case  # noqa: E402

if DEVICE.type == "cpu":  # the kernel calls triton_w8a16's and triton_fused_mlp's helpers: interpret those too
    _, triton_fused_mlp, triton_streamk_mlp = reload_interpreted_chain(
        (triton_w8a16, "_w8a16_kernel"), (triton_fused_mlp, "_fused_mlp_kernel"),
        (triton_streamk_mlp, "_streamk_mlp_kernel"))
    fix_interpreter()

TILINGS = [  # (hidden, inter, bk1, bk2): 64-row tiles (bn1 = 32, bn2 = 64)
    (64, 96, 32, 32),  # 3 gate|up tiles of 2 chunks, 1 down tile of 3
    (128, 64, 64, 32),  # 2 gate|up tiles of 2 chunks, 2 down tiles of 2
    (64, 128, 64, 128),  # one chunk a tile
]


def run(args, hidden, inter, bk1, bk2, bufs=None):
    bufs = bufs or triton_streamk_mlp.StreamKBuffers.make(hidden, inter, 1, 32, bk1, 64, bk2, DEVICE)
    out, res_out = triton_streamk_mlp.streamk_mlp_fp8(*args, 1e-5, bufs, 1, bn1=32, bk1=bk1, bn2=64, bk2=bk2)
    return out, res_out, bufs


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), tiling=st.sampled_from(TILINGS))
def test_kernel_equals_reference(seed: int, tiling) -> None:
    hidden, inter, bk1, bk2 = tiling
    args = case(hidden, inter, seed)
    ref, ref_res = triton_fused_mlp.fused_mlp_reference(*args, 1e-5)
    out, res_out, bufs = run(args, hidden, inter, bk1, bk2)
    assert torch.equal(res_out, ref_res)  # bf16(x + residual), one rounding
    assert_close_to(out, ref)
    assert int(bufs.counter.item()) == 2  # one program, two barriers


def test_successive_launches_keep_their_own_amax() -> None:
    """Shared buffers across launches: each launch gets its own act amax (the slot the launch before cleared),
    so a small act row after a large one is not flushed to zero by a stale scale."""
    big, small = case(64, 96, 3), case(64, 96, 4)
    small[4] = small[4] * 1e-3
    bufs = None
    for args in (big, big, small, small):
        ref, _ = triton_fused_mlp.fused_mlp_reference(*args, 1e-5)
        out, _, bufs = run(args, 64, 96, 32, 32, bufs)
        assert_close_to(out, ref)
    assert int(bufs.counter.item()) == 8


def test_wrong_gate_up_order_is_caught() -> None:
    args = case(64, 96, 0)
    ref, _ = triton_fused_mlp.fused_mlp_reference(*args, 1e-5)
    x, res, norm, w_gu, s_gu, w_d, s_d = args
    swapped = [x, res, norm, torch.cat([w_gu[96:], w_gu[:96]]), torch.cat([s_gu[96:], s_gu[:96]]), w_d, s_d]
    out, _, _ = run(swapped, 64, 96, 32, 32)
    assert (out.double() - ref.double()).abs().max().item() > 0.05 * ref.double().abs().max().item()


def owners(tiles: int, chunks: int, programs: int) -> list[list[int]]:
    """Brute force: the programs whose ranges [p W // P, (p + 1) W // P) hold a chunk of each tile, in order."""
    w = tiles * chunks
    meet: list[list[int]] = [[] for _ in range(tiles)]
    for p in range(programs):
        for c in range(p * w // programs, (p + 1) * w // programs):
            if p not in meet[c // chunks]:
                meet[c // chunks].append(p)
    return meet


@settings(max_examples=200, deadline=None)
@given(tiles=st.integers(1, 70), chunks=st.integers(1, 120), programs=st.integers(1, 300))
def test_stream_k_split_matches_brute_force(tiles: int, chunks: int, programs: int) -> None:
    """The kernel's formulas (_share_tile: first contributor p0 and count n; the chunk owner) and
    max_contributors against a brute-force walk of the ranges; every chunk in exactly one range."""
    w = tiles * chunks
    if programs > w:
        return
    meet = owners(tiles, chunks, programs)
    for t, progs in enumerate(meet):
        p0 = ((t * chunks + 1) * programs - 1) // w
        n = ((t + 1) * chunks * programs - 1) // w - p0 + 1
        assert progs == list(range(p0, p0 + n))
    assert triton_streamk_mlp.max_contributors(tiles, chunks, programs) == max(len(m) for m in meet)
    assert sum((p + 1) * w // programs - p * w // programs for p in range(programs)) == w


def test_llama_8b_split() -> None:
    """The shapes it is built for, 132 programs: gate|up tiles meet at most 2 programs, down tiles 3."""
    assert triton_streamk_mlp.max_contributors(14336 // 32, 4096 // 128, 132) == 2
    assert triton_streamk_mlp.max_contributors(4096 // 64, 14336 // 128, 132) == 3


@pytest.mark.parametrize("bad,match", [
    (dict(bn1=16), "weight rows"),
    (dict(bk1=48), "do not tile"),
    (dict(programs=1000), "fewer chunks"),
])
def test_tiling_problems_are_named(bad: dict, match: str) -> None:
    tiles = dict(bn1=32, bk1=32, bn2=64, bk2=32) | {k: v for k, v in bad.items() if k != "programs"}
    assert match in triton_streamk_mlp.tiling_problem(64, 96, bad.get("programs", 1), **tiles)
    args = case(64, 96, 1)
    bufs = triton_streamk_mlp.StreamKBuffers.make(64, 96, 1, 32, 32, 64, 32, DEVICE)
    with pytest.raises(ValueError, match=match):
        triton_streamk_mlp.streamk_mlp_fp8(*args, 1e-5, bufs, bad.get("programs", 1), **tiles)
