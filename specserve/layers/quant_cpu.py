"""Linear layers straight from GGUF block-quantized weights on CPU (Q4_1 and Q8_0).

Decoding on CPU is memory-bandwidth bound: every step streams every weight once, so a 4-bit weight
(Q4_1: 0.75 byte per weight as stored here) is read ~5x faster than an fp32 one. ``QuantizedWeight`` keeps
the GGUF blocks split into integer codes and float32 scales; ``quant_linear`` runs the C++ kernel in
``specserve/kernels/cpu_quant_gemm.cpp`` (AVX2+FMA where the CPU has it, scalar otherwise), built on first use
with ``torch.utils.cpp_extension`` into the specserve cache. ``load_extension()`` returns None when the build
fails; callers then keep fp32 weights (``QuantizedWeight.dequantize()``).

Block formats (ggml's, 32 consecutive weights along in_features of one output row):
    Q4_1: 20 bytes = d f16, m f16, qs[16] u8;  w[j] = d * (qs[j] & 0xF) + m,  w[j + 16] = d * (qs[j] >> 4) + m
    Q8_0: 34 bytes = d f16, qs[32] i8;         w[j] = d * qs[j]

Activations (``activation_quant``, from ``EngineConfig.cpu_activation_quant``):
    "none" (default, the oracle): x stays float32; the kernel converts the codes to float and FMAs them with x.
    "q8": each row of x is first quantized per block of 32 to int8 with one float32 scale (the idea of llama.cpp's
          Q8_1 activation blocks; our own code): dx = max|x| / 127, xq = round-half-even(x / dx) in [-127, 127],
          x ~ dx * xq. The kernel then takes exact integer dot products of the codes with xq (AVX2 maddubs/madd)
          and computes ``sum_g (d * dx) * (q . xq) + m * dx * sum(xq)``, i.e. exactly
          ``dequantize() @ (dx * xq)`` up to float32 rounding (``q8_reference`` is that computation in torch).
          Numerics change: x itself is rounded to ~8 bits per block (relative error up to 1/254 of the block's
          largest |x| per element), so logits differ slightly from "none"; each row's result still does not depend
          on the other rows of the call, so speculative greedy output equals plain greedy output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from specserve.kernels.loader import CpuKernel

QType = Literal["q4_1", "q8_0"]
ActivationQuant = Literal["none", "q8"]
ACTIVATION_QUANTS = ("none", "q8")
BLOCK_SIZE = 32  # weights per block
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
CODE_BYTES = {"q4_1": 16, "q8_0": 32}  # integer codes per block, in bytes
KERNEL = CpuKernel("specserve_cpu_quant_gemm", "cpu_quant_gemm.cpp", "SPECSERVE_DISABLE_QUANT_KERNEL")
build_extension = KERNEL.build
load_extension = KERNEL.load


@dataclass
class QuantizedWeight:
    """A ``[out_features, in_features]`` weight kept as GGUF blocks.

    qs: ``[out_features, in_features / 32, 16]`` uint8 (q4_1) or ``[..., 32]`` int8 (q8_0), the integer codes.
    d, m: ``[out_features, in_features / 32]`` float32 scale and minimum (m is None for q8_0).
    """

    qtype: QType
    out_features: int
    in_features: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    # the codes in the int8-activation kernel's layout, built on first use (``int8_codes()``)
    _int8_codes: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    # activation_quant -> (kernel function, its arguments after x), bound on first use (``kernel()``)
    _kernels: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported qtype {self.qtype!r}; expected one of {sorted(BLOCK_BYTES)}")
        if self.in_features % BLOCK_SIZE:
            raise ValueError(f"in_features={self.in_features} is not a multiple of {BLOCK_SIZE}")
        groups = self.in_features // BLOCK_SIZE
        code_dtype = torch.uint8 if self.qtype == "q4_1" else torch.int8
        if self.qs.shape != (self.out_features, groups, CODE_BYTES[self.qtype]) or self.qs.dtype != code_dtype:
            raise ValueError(f"{self.qtype} qs must be {code_dtype} [{self.out_features}, {groups}, "
                             f"{CODE_BYTES[self.qtype]}], got {self.qs.dtype} {list(self.qs.shape)}")
        for name, t in (("d", self.d), ("m", self.m)):
            if t is None and not (name == "m" and self.qtype == "q8_0"):
                raise ValueError(f"{self.qtype} needs {name}")
            if t is not None and (t.shape != (self.out_features, groups) or t.dtype != torch.float32):
                raise ValueError(f"{name} must be float32 [{self.out_features}, {groups}], "
                                 f"got {t.dtype} {list(t.shape)}")
        if self.qtype == "q8_0" and self.m is not None:
            raise ValueError("q8_0 has no m")

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The kernel's arguments after x: (qs, d, m) for q4_1, (qs, d) for q8_0."""
        return (self.qs, self.d) if self.m is None else (self.qs, self.d, self.m)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @classmethod
    def from_gguf_bytes(
        cls,
        raw: np.ndarray,  # [out_features, row_bytes] uint8, as gguf.GGUFReader's tensor.data
        qtype: QType,
        out_features: int,
        in_features: int,
    ) -> QuantizedWeight:
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported qtype {qtype!r}; expected one of {sorted(BLOCK_BYTES)}")
        if in_features % BLOCK_SIZE:
            raise ValueError(f"in_features={in_features} is not a multiple of {BLOCK_SIZE}")
        groups = in_features // BLOCK_SIZE
        row_bytes = groups * BLOCK_BYTES[qtype]
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        if raw.size != out_features * row_bytes:
            raise ValueError(f"{qtype} [{out_features}, {in_features}] needs {out_features * row_bytes} bytes, "
                             f"got {raw.size}")
        blocks = torch.from_numpy(raw.reshape(out_features, groups, BLOCK_BYTES[qtype]).copy())
        # [N, G, block_bytes] -> f16 scales (bytes 0-1, and 2-3 for q4_1 m) and the codes after them
        d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
        if qtype == "q4_1":
            m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
            qs = blocks[..., 4:].contiguous()
            return cls(qtype, out_features, in_features, qs, d, m)
        qs = blocks[..., 2:].contiguous().view(torch.int8)
        return cls(qtype, out_features, in_features, qs, d, None)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,  # [out_features, in_features], in_features a multiple of 32
        qtype: QType,
    ) -> QuantizedWeight:
        """Quantize a float weight to GGUF blocks with the ``gguf`` package's reference quantizer (Q8_0: one f16
        scale ``max|w| / 127`` per block of 32 and codes ``round(w / scale)``)."""
        from gguf import GGMLQuantizationType, quants
        out_features, in_features = weight.shape
        if in_features % BLOCK_SIZE:
            raise ValueError(f"in_features={in_features} is not a multiple of {BLOCK_SIZE}")
        kind = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}[qtype]
        raw = quants.quantize(weight.detach().float().cpu().contiguous().numpy(), kind)
        return cls.from_gguf_bytes(raw, qtype, out_features, in_features)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Output rows ``index`` (any order, repeats allowed): the weight ``dequantize()[index]``."""
        index = torch.as_tensor(index, dtype=torch.long)
        return QuantizedWeight(self.qtype, int(index.numel()), self.in_features, self.qs[index].contiguous(),
                               self.d[index].contiguous(), None if self.m is None else self.m[index].contiguous())

    @classmethod
    def cat(cls, weights: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack along out_features (fused q|k|v, gate|up): the weight ``cat([w.dequantize() for w in weights])``."""
        if not weights:
            raise ValueError("cat of no weights")
        first = weights[0]
        for w in weights[1:]:
            if w.qtype != first.qtype or w.in_features != first.in_features:
                raise ValueError(f"cannot cat {w.qtype} [*, {w.in_features}] onto {first.qtype} "
                                 f"[*, {first.in_features}]")
        m = None if first.m is None else torch.cat([w.m for w in weights])
        return cls(first.qtype, sum(w.out_features for w in weights), first.in_features,
                   torch.cat([w.qs for w in weights]), torch.cat([w.d for w in weights]), m)

    def int8_codes(self) -> torch.Tensor:  # [out_features, row_bytes] uint8 (q4_1) / int8 (q8_0)
        """The codes as the int8-activation kernel reads them (built once, then kept: as many bytes again as qs).

        Per output row, each chunk of 8 groups is interleaved so that one 32-byte vector carries 4 codes of each of
        the 8 groups (see ``cpu_quant_gemm.cpp``); the last ``G % 8`` groups keep GGUF's layout.
        Q8_0: chunk byte ``32j + 4i + e`` = code of weight ``4j + e`` of the chunk's group ``i`` (256 bytes).
        Q4_1: chunk byte ``32t + 4i + e`` = codes of weights ``8t + e`` (low nibble) and ``8t + 4 + e`` (high) of
        group ``i`` (128 bytes)."""
        if self._int8_codes is None:
            self._int8_codes = q4_1_int8_layout(self.qs) if self.qtype == "q4_1" else q8_0_int8_layout(self.qs)
        return self._int8_codes

    def kernel(self, activation_quant: ActivationQuant = "none") -> tuple:
        """``(fn, args)``: ``fn(x, *args)`` is ``x @ dequantize().T`` for a 2D contiguous float32 x, taking x as
        ``activation_quant`` says. Bound once: a decode step calls it for every projection of every layer."""
        bound = self._kernels.get(activation_quant)
        if bound is None:
            ext = load_extension()
            if ext is None:
                raise RuntimeError("the quantized CPU kernel is unavailable (see the log); keep fp32 weights instead")
            if activation_quant not in ACTIVATION_QUANTS:
                raise ValueError(f"activation_quant must be one of {ACTIVATION_QUANTS}, got {activation_quant!r}")
            if activation_quant == "none":
                bound = (ext.q4_1_gemm if self.qtype == "q4_1" else ext.q8_0_gemm), self.tensors
            elif self.qtype == "q4_1":
                bound = ext.q4_1_gemm_q8, (self.int8_codes(), self.d, self.m)
            else:
                bound = ext.q8_0_gemm_q8, (self.int8_codes(), self.d)
            self._kernels[activation_quant] = bound
        return bound

    def dequantize(self) -> torch.Tensor:  # [out_features, in_features] float32
        """Reference dequantization in plain torch; bit-identical to ``gguf.quants.dequantize``."""
        if self.qtype == "q4_1":
            codes = torch.cat([self.qs & 0xF, self.qs >> 4], dim=-1).float()  # [N, G, 32]: low nibbles, then high
            w = codes * self.d.unsqueeze(-1) + self.m.unsqueeze(-1)  # two roundings, as gguf (no FMA on this path)
        else:
            w = self.qs.float() * self.d.unsqueeze(-1)
        return w.reshape(self.out_features, self.in_features)


def q4_1_int8_layout(
    qs: torch.Tensor,  # [out_features, groups, 16] uint8, GGUF's Q4_1 codes
) -> torch.Tensor:  # [out_features, groups // 8 * 128 + groups % 8 * 16] uint8
    """GGUF Q4_1 codes -> the int8-activation kernel's layout (``QuantizedWeight.int8_codes``)."""
    n, groups, _ = qs.shape
    chunked = groups // 8 * 8
    codes = torch.cat([qs[:, :chunked] & 0xF, qs[:, :chunked] >> 4], dim=-1)  # [N, chunked, 32]: weights in order
    # [N, chunk, group i, word j, byte e] -> [N, chunk, j, i, e]: vector j holds word j (4 codes) of each group
    words = codes.reshape(n, groups // 8, 8, 8, 4).transpose(2, 3).reshape(n, groups // 8, 8, 32)
    packed = words[:, :, 0::2] | (words[:, :, 1::2] << 4)  # [N, chunk, 4, 32]: vector 2t low nibbles, 2t+1 high
    tail = qs[:, chunked:].reshape(n, -1)
    return torch.cat([packed.reshape(n, -1), tail], dim=1).contiguous()


def q8_0_int8_layout(
    qs: torch.Tensor,  # [out_features, groups, 32] int8, GGUF's Q8_0 codes
) -> torch.Tensor:  # [out_features, groups * 32] int8
    """GGUF Q8_0 codes -> the int8-activation kernel's layout (``QuantizedWeight.int8_codes``)."""
    n, groups, _ = qs.shape
    chunked = groups // 8 * 8
    words = qs[:, :chunked].reshape(n, groups // 8, 8, 8, 4).transpose(2, 3)  # [N, chunk, word j, group i, byte e]
    return torch.cat([words.reshape(n, -1), qs[:, chunked:].reshape(n, -1)], dim=1).contiguous()


def quant_linear(
    x: torch.Tensor,  # [num_rows, in_features] (any leading dims)
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out_features]
    activation_quant: ActivationQuant = "none",
) -> torch.Tensor:  # [num_rows, out_features]
    """``F.linear(x, weight.dequantize(), bias)`` computed from the blocks; needs ``load_extension()``.
    ``activation_quant="q8"`` quantizes x per block of 32 to int8 first (see the module docstring)."""
    fn, args = weight.kernel(activation_quant)
    if x.dim() == 2 and x.dtype == torch.float32:  # the decode path: no reshape or cast (the kernel checks shapes)
        y = fn(x, *args)
    else:
        lead = x.shape[:-1]
        y = fn(x.reshape(-1, weight.in_features).to(torch.float32).contiguous(), *args)
        y = y.reshape(*lead, weight.out_features).to(x.dtype)
    if bias is not None:
        y.add_(bias)
    return y


def quantize_q8_reference(
    x: torch.Tensor,  # [num_rows, in_features] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # xq [num_rows, in_features / 32, 32] float32 integers, dx [num_rows, G]
    """The kernel's per-block int8 quantization of x in plain torch (bit-identical to ``ext.quantize_q8``)."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK_SIZE)  # [M, G, 32]
    dx = blocks.abs().amax(dim=-1) / 127.0  # [M, G]
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    xq = torch.round(blocks * inv.unsqueeze(-1))  # half to even, as the kernel's cvtps / nearbyint
    return xq, dx


def q8_reference(
    x: torch.Tensor,  # [num_rows, in_features] float32
    weight: QuantizedWeight,
) -> torch.Tensor:  # [num_rows, out_features] float64
    """What ``quant_linear(x, weight, activation_quant="q8")`` computes, in float64 torch: the dequantized weight
    times the int8-quantized x (``dx * xq``); the kernel differs from it by float32 rounding only."""
    xq, dx = quantize_q8_reference(x)
    x_hat = (xq.double() * dx.double().unsqueeze(-1)).reshape(x.shape[0], weight.in_features)
    return x_hat @ weight.dequantize().double().T
