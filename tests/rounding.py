"""Tolerances "up to rounding" shared by tests: a GEMM kernel's output against exact (fp64) maths (the Triton GEMM /
GEMV tests), and a top-k / top-p filter's kept tokens against the full sort's (the sampler tests)."""

from __future__ import annotations

import torch


def assert_rounded_from(
    out: torch.Tensor,  # [M, N] the kernel's output, any float dtype
    ref: torch.Tensor,  # [M, N] fp64 exact maths
    rtol: float = 1e-5,
) -> float:
    """``out`` is ``ref`` up to fp32 summation order (``rtol`` of each row's largest |output|) and one rounding to
    ``out.dtype`` (half an ulp). Returns the tolerance's scale (the smallest row bound) for callers' contrasts."""
    ref, got = ref.cpu(), out.cpu().double()
    slack = rtol * ref.abs().amax(dim=1, keepdim=True)  # [M, 1]
    mantissa = torch.finfo(out.dtype).eps  # 2^-mantissa_bits
    _, exp = torch.frexp((ref.abs() + slack).float())  # |v| < 2^exp
    half_ulp = torch.ldexp(torch.full_like(ref, mantissa / 2), exp.to(torch.float64) - 1)
    half_ulp = half_ulp.clamp(min=torch.finfo(out.dtype).smallest_normal * mantissa / 2)
    err = (got - ref).abs()
    bound = slack + half_ulp
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g} (err {err.max().item():.3g})"
    return slack.min().item()


def linear_case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int, device: torch.device):
    """Seeded operands of a 16-bit linear: x ``[m, k]`` ~ N(0, 1), W ``[n, k]`` ~ N(0, 1/k) (outputs O(1)), bias
    ``[n]`` ~ N(0, 1) or None; drawn on CPU, then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x.to(device), w.to(device), None if b is None else b.to(device)


def fp64_linear(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [N, K]
    b: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] fp64: x @ W.T + b exactly (up to fp64 rounding)
    out = x.double() @ w.double().t()
    return out if b is None else out + b.double()


def unexplained_differences(z: torch.Tensor, keep: torch.Tensor, want: torch.Tensor, k: int, p: float,
                            rel: float = 3e-6) -> list[int]:
    """Tokens of this row kept by one filter and not the other that neither a tie with the sort's last kept value
    nor fp32 rounding explains: with top-p, the mass before the token (fp64, under the top-k-normalised softmax)
    within ``rel`` of p."""
    order = z.double().sort(descending=True)
    vals = order.values[:k]
    probs = (vals - vals[0]).exp()
    probs /= probs.sum()
    before = torch.full_like(z, float("nan"), dtype=torch.float64)
    before[order.indices[:k]] = probs.cumsum(0) - probs
    edge = z[want].min()  # the sort's last kept value
    bad = []
    for tok in (keep != want).nonzero().flatten().tolist():
        tied = z[tok] == edge and int((z == edge).sum()) > 1
        if tied or (p < 1.0 and abs(float(before[tok]) - p) < rel):
            continue
        bad.append(tok)
    return bad
