"""The gated MLP as C independent branches over slices of its intermediate dimension, for verify-sized steps on
CUDA: ``down(silu(gate) * up) = sum_c down_c(silu(gate_c) * up_c)``, where gate_c / up_c are rows
``c * w .. (c + 1) * w`` of gate and up (w = intermediate / C) and down_c is down's column slice c.

Why: a verify step of a batch of 32 sequences x 8 tokens is 256 rows, and at 256 rows the gate|up GEMM of
Llama-3.1-8B (N = 28672) runs as 224 output tiles on 132 SMs: 1.7 waves, with 40 SMs idle through the second
(``benchmarks/cublaslt_algos_gpu.py``: no cuBLAS algorithm tiles it better). As branches on two CUDA streams,
one slice's SiLU and down GEMM start on the SMs that the other slice's gate|up tail leaves idle
(``benchmarks/mlp_branches_gpu.py`` measures it). The partial sums stay in float32 (``torch.mm`` with
``out_dtype``) and are rounded once, so the branches are a split-K of down with no extra 16-bit rounding.

Layout: ``interleave_gate_up`` stores gate|up's rows per slice, ``[gate_0; up_0; gate_1; up_1; ...]``, so each
slice's rows are one contiguous view and no weight is copied. Steps with fewer rows keep one gate|up GEMM; its
output ``[n, 2 * inter]`` viewed as ``[n * C, 2 * w]`` is exactly what ``silu_and_mul`` takes (each row: a
slice's gate then its up), and its result viewed back as ``[n, inter]`` is in down's column order.

Worked example (inter = 4, C = 2, w = 2): gate rows g0..g3, up rows u0..u3 are stored as
[g0, g1, u0, u1, g2, g3, u2, u3]; a row of the GEMM's output is [G0, G1, U0, U1, G2, G3, U2, U3]; viewed as two
rows [G0, G1, U0, U1] and [G2, G3, U2, U3], silu_and_mul gives [s(G0)U0, s(G1)U1] and [s(G2)U2, s(G3)U3], which
side by side are columns 0..3 of the activation, down's input order.
"""

from __future__ import annotations

import torch

from specserve.layers.linear import dense_linear
from specserve.layers.ops import TorchOps


def interleave_gate_up(
    weight: torch.Tensor,  # [2 * inter, in_features]: gate rows, then up rows
    num_slices: int,
) -> torch.Tensor:  # [2 * inter, in_features]: rows [gate_0; up_0; gate_1; up_1; ...] (module docstring)
    two_inter, cols = weight.shape
    width = two_inter // (2 * num_slices)
    # [2 (gate, up), C, w, cols] -> [C, 2, w, cols]: slice-major
    return weight.view(2, num_slices, width, cols).transpose(0, 1).reshape(two_inter, cols)


def silu_and_mul_sliced(
    ops: TorchOps,
    gate_up: torch.Tensor,  # [n, 2 * inter] in the interleaved layout
    num_slices: int,
) -> torch.Tensor:  # [n, inter]: silu(gate) * up in down's column order
    n = gate_up.shape[0]
    return ops.silu_and_mul(gate_up.reshape(n * num_slices, -1)).view(n, -1)


def down_partial(
    act: torch.Tensor,  # [n, w]: one slice's silu(gate_c) * up_c
    down_slice: torch.Tensor,  # [hidden, w]: down's column slice c (a strided view)
) -> torch.Tensor:  # [n, hidden], float32 or wider: the slice's share of down(act), not rounded to 16 bits
    acc = torch.promote_types(act.dtype, torch.float32)
    if act.device.type == "cuda" and acc != act.dtype:
        return torch.mm(act, down_slice.t(), out_dtype=acc)
    return act.to(acc) @ down_slice.to(acc).t()


class MlpBranches:
    """Runs one MLP's slices as branches: slice c on stream c mod (1 + len(side_streams)), the current stream
    being stream 0. ``side_streams`` is empty on CPU (the slices run one after another: the same maths)."""

    def __init__(
        self,
        gate_up: torch.Tensor,  # [2 * inter, hidden], interleaved (interleave_gate_up)
        down: torch.Tensor,  # [hidden, inter]
        num_slices: int,
        side_streams: list,
    ) -> None:
        inter = down.shape[1]
        width = inter // num_slices
        self.num_slices = num_slices
        self.side_streams = side_streams
        self.slices = [(gate_up[2 * c * width:2 * (c + 1) * width], down[:, c * width:(c + 1) * width])
                       for c in range(num_slices)]

    def __call__(
        self,
        ops: TorchOps,
        x: torch.Tensor,  # [n, hidden]
    ) -> torch.Tensor:  # [n, hidden], x.dtype
        lanes = 1 + len(self.side_streams)
        main = torch.cuda.current_stream(x.device) if self.side_streams else None
        for s in self.side_streams:
            s.wait_stream(main)
        parts = []
        for c, (gate_up_c, down_c) in enumerate(self.slices):
            lane = c % lanes
            if lane == 0:
                parts.append(down_partial(ops.silu_and_mul(dense_linear(x, gate_up_c)), down_c))
                continue
            with torch.cuda.stream(self.side_streams[lane - 1]):
                parts.append(down_partial(ops.silu_and_mul(dense_linear(x, gate_up_c)), down_c))
        for s in self.side_streams:
            main.wait_stream(s)
        total = parts[0]
        for p in parts[1:-1]:
            total = total + p
        out = torch.empty(x.shape[0], total.shape[1], dtype=x.dtype, device=x.device)
        if len(parts) == 1:
            return out.copy_(total)
        return torch.add(total, parts[-1], out=out)  # fp32 sum, one rounding
