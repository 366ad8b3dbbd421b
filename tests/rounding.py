"""Tolerance of a GEMM kernel's output against exact (fp64) maths, shared by the Triton GEMM / GEMV tests."""

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
