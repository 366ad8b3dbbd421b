"""The Triton inverse-CDF draw (``layers/triton_sampler.py``) against ``sampler.draw_tokens_reference``.

Without a GPU the kernel runs under Triton's interpreter. The two forms sum the row's mass in different orders,
so a draw may differ where ``u * total`` lies within a few fp64 ulps of a cumulative-mass boundary; the property
tests compare every draw whose target is farther than 1e-12 of the row's mass from each boundary (nearly all),
and the edge cases (u = 0, u -> 1, zero-mass tokens at either end, one token with mass) exactly.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.layers.sampler import draw_tokens_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
from specserve.layers import triton_sampler  # noqa: E402
from tests.rounding import unexplained_differences  # noqa: E402
from tests.triton_interpreter import fix_interpreter, reload_interpreted  # noqa: E402

if DEVICE.type == "cpu":
    triton_sampler = reload_interpreted(triton_sampler, "_draw_kernel")
    fix_interpreter()


def draw(probs: torch.Tensor, uniforms: list[float], block: int | None = None) -> list[int]:
    """The kernel's tokens for ``probs [rows, vocab]`` (moved to DEVICE), with ``DRAW_BLOCK`` = ``block``."""
    saved = triton_sampler.DRAW_BLOCK
    triton_sampler.DRAW_BLOCK = block or saved
    try:
        u = torch.tensor(uniforms, dtype=torch.float64, device=DEVICE)
        return triton_sampler.draw_tokens_triton(probs.to(DEVICE), u).tolist()
    finally:
        triton_sampler.DRAW_BLOCK = saved


def reference(probs: torch.Tensor, uniforms: list[float]) -> list[int]:
    return draw_tokens_reference(probs, torch.tensor(uniforms, dtype=torch.float64)).tolist()


def far_from_boundaries(probs: torch.Tensor, uniforms: list[float], rel: float = 1e-12) -> list[bool]:
    """Per row: whether ``u * total`` is farther than ``rel * total`` from every cumulative-mass boundary."""
    cdf = probs.double().cumsum(dim=-1)  # [rows, vocab]
    target = torch.tensor(uniforms, dtype=torch.float64)[:, None] * cdf[:, -1:]
    return ((cdf - target).abs() > rel * cdf[:, -1:]).all(dim=-1).tolist()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 4), vocab=st.integers(1, 300),
       zero_every=st.integers(0, 5), block=st.sampled_from([16, 64, 2048]))
def test_the_kernel_draws_the_reference_token(seed, rows, vocab, zero_every, block) -> None:
    """Random unnormalised rows (zero-mass tokens at the ends and between, vocabularies of one to several
    blocks, a partial last block): the kernel's token is the reference's, and always has mass."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 5
    if zero_every:
        probs[:, ::zero_every] = 0.0
    probs[:, vocab // 2] += 0.25  # every row keeps some mass
    rng = random.Random(seed)
    for uniforms in ([rng.random() for _ in range(rows)], [0.0] * rows, [1.0 - 2**-53] * rows):
        got, want = draw(probs, uniforms, block), reference(probs, uniforms)
        far = far_from_boundaries(probs, uniforms)
        for row, tok in enumerate(got):
            assert probs[row, tok] > 0
            if far[row] or uniforms[row] in (0.0, 1.0 - 2**-53):
                assert tok == want[row], (row, uniforms[row])


def test_a_grid_of_uniforms_lands_in_each_tokens_interval() -> None:
    """Uniforms on a grid, one row per uniform: each token is drawn for exactly the grid points inside its
    interval of the cumulative mass (so with frequency ~ its probability), across block edges."""
    probs = torch.tensor([0.0, 1.0, 0.0, 0.0, 2.0, 1.0, 0.0, 4.0, 0.0])  # total 8; intervals of width 1, 2, 1, 4
    n = 64
    uniforms = [(i + 0.5) / n for i in range(n)]
    got = draw(probs.expand(n, -1).contiguous(), uniforms, block=16)
    counts = {tok: got.count(tok) for tok in set(got)}
    assert counts == {1: 8, 4: 16, 5: 8, 7: 32}
    assert got == reference(probs.expand(n, -1).contiguous(), uniforms)
    # the same with blocks of 16 over a vocabulary of 40: the mass sits in three blocks
    wide = torch.zeros(40)
    wide[3], wide[17], wide[18], wide[39] = 1.0, 2.0, 1.0, 4.0
    got = draw(wide.expand(n, -1).contiguous(), uniforms, block=16)
    assert {tok: got.count(tok) for tok in set(got)} == {3: 8, 17: 16, 18: 8, 39: 32}


def test_one_token_with_mass_is_always_drawn() -> None:
    for vocab, at in ((1, 0), (50, 0), (50, 49), (50, 17)):
        probs = torch.zeros(3, vocab)
        probs[:, at] = 1e-30
        assert draw(probs, [0.0, 0.5, 1.0 - 2**-53], block=16) == [at, at, at]


def test_rows_with_a_stride_and_the_docstring_example() -> None:
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25]])
    assert draw(probs, [0.6], block=16) == [2]
    padded = torch.zeros(2, 8)
    padded[:, :4] = torch.tensor([[0.5, 0.0, 0.25, 0.25], [0.0, 0.0, 3.0, 1.0]])
    assert draw(padded[:, :4], [0.6, 0.8], block=16) == [2, 3]  # row stride 8, not 4
    assert draw(torch.zeros(0, 5), [], block=16) == []


def thresholds_keep(z: torch.Tensor, k_eff: list[int], top_p: list[float], top_p_cand: int) -> torch.Tensor:
    """The kernel's kept tokens ``[rows, vocab]`` (bool), with ``top_p_cand`` candidates for top-p-only rows (the
    host's rule in ``sampler._filter_thresholds``)."""
    vocab = z.shape[1]
    need = [0 if k == vocab and p >= 1.0 else k if k < vocab else top_p_cand for k, p in zip(k_eff, top_p)]
    zd = z.to(DEVICE)
    vals = zd.topk(max(max(need), 1), dim=-1).values
    tau = triton_sampler.top_k_top_p_thresholds_triton(
        zd, vals, torch.tensor(k_eff, dtype=torch.int64, device=DEVICE),
        torch.tensor(top_p, dtype=torch.float32, device=DEVICE))
    return (zd >= tau[:, None]).cpu()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.lists(st.tuples(st.sampled_from([0, 1, 7, 64, 300]),
                                                            st.sampled_from([1.0, 0.5, 0.9, 0.99, 0.999999]),
                                                            st.sampled_from([0.1, 2.0, 8.0])),
                                                  min_size=1, max_size=5))
def test_thresholds_keep_the_sorts_tokens(seed, rows) -> None:
    """Top-k / top-p as one threshold per row keeps the tokens the full sort (``_filter_sorted``) keeps, for rows
    of every kind in one launch: unfiltered, top-k only, top-p resolved among the candidates, top-k and top-p,
    and a flat row whose nucleus runs past the candidates (the search over the row). A token may differ only
    where fp32 rounding of its mass before it (within 3e-6 of p) or a tie at the edge decides (p = 0.999999 puts
    several tail tokens of ~1e-8 each there)."""
    from specserve.layers.sampler import _filter_sorted
    vocab, cand = 2048, 64
    gen = torch.Generator().manual_seed(seed)
    z = torch.cat([torch.randn(1, vocab, generator=gen) * scale for _, _, scale in rows])
    k_eff = [k if 0 < k < vocab else vocab for k, _, _ in rows]
    top_p = [p for _, p, _ in rows]
    got = thresholds_keep(z, k_eff, top_p, cand)
    want = torch.isfinite(_filter_sorted(z, k_eff, top_p))
    for r in range(len(rows)):
        assert unexplained_differences(z[r], got[r], want[r], k_eff[r], top_p[r]) == [], (r, rows[r])
        assert bool(got[r][z[r].argmax()])  # the top token always stays


def test_a_flat_row_is_searched_past_the_candidates() -> None:
    """A nucleus of ~1,800 tokens with 64 candidates: the kernel's threshold keeps exactly the sort's tokens, and
    a top-k-only row beside it keeps its k."""
    from specserve.layers.sampler import _filter_sorted
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(2, 2048, generator=gen) * 0.1
    k_eff, top_p = [2048, 40], [0.9, 1.0]
    got = thresholds_keep(z, k_eff, top_p, 64)
    want = torch.isfinite(_filter_sorted(z, k_eff, top_p))
    assert int(want[0].sum()) > 1000 and torch.equal(got, want)
    assert int(got[1].sum()) == 40


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the dispatch takes the kernel on CUDA only")
def test_draw_tokens_takes_the_kernel_on_cuda() -> None:
    from specserve.layers.sampler import draw_tokens
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(8, 128_256, generator=gen).softmax(dim=-1)
    uniforms = [random.Random(i).random() for i in range(8)]
    assert draw_tokens(probs.to(DEVICE), uniforms).tolist() == reference(probs, uniforms)


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specserve.layers import triton_sampler
fn = triton_sampler._draw_kernel
signature = {"probs_ptr": "*fp32", "u_ptr": "*fp64", "out_ptr": "*i64", "vocab_size": "i32", "stride_row": "i32",
             "BLOCK": "constexpr"}
for block, warps in ((triton_sampler.DRAW_BLOCK, 8), (64, 4)):
    k = triton.compile(ASTSource(fn, signature, {"BLOCK": block}), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    print("compiled", block, len(k.asm["ptx"]) > 0)
fn = triton_sampler._threshold_kernel
signature = {"z_ptr": "*fp32", "vals_ptr": "*fp32", "k_ptr": "*i64", "p_ptr": "*fp32", "tau_ptr": "*fp32",
             "vocab_size": "i32", "num_cand": "i32", "stride_z": "i32", "stride_v": "i32", "BLOCK": "constexpr",
             "SPLITS": "constexpr", "SEARCH_BLOCK": "constexpr"}
k = triton.compile(ASTSource(fn, signature, {"BLOCK": triton_sampler.THRESHOLD_BLOCK,
                                       "SPLITS": triton_sampler.THRESHOLD_SPLITS,
                                       "SEARCH_BLOCK": triton_sampler.THRESHOLD_SEARCH_BLOCK}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
print("compiled thresholds", len(k.asm["ptx"]) > 0)
"""


@pytest.mark.slow
def test_the_kernels_compile_for_hopper(tmp_path) -> None:
    # The interpreter never lowers the kernels (fp64 scans, the float-key search): compile them for sm_90 without a GPU.
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], cwd=root, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("True") == 3, result.stdout


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the dispatch takes the kernel on CUDA only")
def test_apply_top_k_top_p_takes_the_thresholds_on_cuda() -> None:
    from specserve.layers.sampler import _filter_sorted, apply_top_k_top_p
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(4, 49_152, generator=gen) * torch.tensor([[8.0], [2.0], [0.5], [2.0]])
    k, p = [0, 50, 0, 0], [0.9, 0.95, 0.95, 1.0]
    got = torch.isfinite(apply_top_k_top_p(z.to(DEVICE), k, p)).cpu()
    want = torch.isfinite(_filter_sorted(z, [kk or 49_152 for kk in k], p))
    for r in range(4):
        assert unexplained_differences(z[r], got[r], want[r], k[r] or 49_152, p[r]) == []
