"""Run Triton kernels on CPU under Triton's interpreter, with four interpreter bugs of Triton 3.6 patched.

``triton.jit`` decides between compiling and interpreting when a kernel is *defined*, from ``TRITON_INTERPRET``,
so it must be set before triton is first imported (``reload_interpreted`` re-imports a kernel module that
was imported earlier without it). Used by the Triton kernel tests (attention, W4A16, CUDA-graph paths).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np


def reload_interpreted(module: ModuleType, kernel_name: str) -> ModuleType:
    """``module`` with its kernels interpreted (reloaded if ``kernel_name`` was compiled for a GPU)."""
    from triton.runtime import interpreter
    if not isinstance(getattr(module, kernel_name), interpreter.InterpretedFunction):
        module = importlib.reload(module)
    return module


def _fp32_to_bf16_bits(data: np.ndarray) -> np.ndarray:
    """float32 values -> bfloat16 bit patterns (uint16), rounded to nearest even as torch and the GPU's
    ``cvt.rn.bf16.f32`` do; NaNs stay (quiet) NaNs."""
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(data)
    return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)


def reload_interpreted_chain(*pairs: tuple[ModuleType, str]) -> list[ModuleType]:
    """``reload_interpreted`` for modules that import kernels from each other, in import order (helpers first):
    once one is reloaded, every later one is too, so that it binds the interpreted helpers."""
    modules, reloaded = [], False
    for module, kernel_name in pairs:
        fresh = importlib.reload(module) if reloaded else reload_interpreted(module, kernel_name)
        reloaded = reloaded or fresh is not module
        modules.append(fresh)
    return modules


def fix_interpreter() -> None:
    """Four bugs of Triton 3.6's interpreter (not of the compiled path), patched for tests only:

    - it keeps a scalar as a 1-element array and turns it into a loop bound with ``int(array)``, which
      NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars",
      triton-lang/triton#9171, fixed upstream by #9172 after 3.6.0): take the one element instead;
    - it stores bfloat16 as raw uint16 bits and ``tl.dot`` multiplies those bits as integers: widen bfloat16
      operands to float32 first (what the tensor cores' fp32 accumulation computes, up to summation order);
    - it casts float32 to bfloat16 by truncating the mantissa (``x.to(tl.bfloat16)`` rounds toward zero, and its
      explicit "rtne" mode rounds ties up without carrying into the exponent): round to nearest even instead,
      as the compiled kernel does, so bf16 results can be compared bit for bit with torch's;
    - its float -> float8 downcast truncates e4m3's subnormals and rounds ties up: convert with torch instead
      (round to nearest even, as the GPU does, saturated to +-448 as ``cvt.rn.satfinite`` does).
    """
    import triton
    from triton.runtime import interpreter
    if getattr(interpreter, "specserve_fixed", False):
        return
    patch_lang_tensor = interpreter._patch_lang_tensor

    def patched_lang_tensor(tensor, scope) -> None:
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def patched_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (self.cast_impl(x, triton.language.float32) if x.dtype.scalar == triton.language.bfloat16 else x
                for x in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    cast_impl = builder.cast_impl
    fp_to_fp = builder.create_fp_to_fp
    bf16, fp32 = triton.language.bfloat16, triton.language.float32

    def patched_cast_impl(self, src, dst_type):
        if src.dtype.scalar == fp32 and dst_type.scalar == bf16:
            return interpreter.TensorHandle(_fp32_to_bf16_bits(src.data), bf16)
        return cast_impl(self, src, dst_type)

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):
        if (src.dtype.scalar == fp32 and dst_type.scalar == bf16
                and rounding_mode == interpreter._ir.ROUNDING_MODE.RTNE):
            return interpreter.TensorHandle(_fp32_to_bf16_bits(src.data), bf16)
        if dst_type.scalar == triton.language.float8e4nv and src.dtype.scalar.primitive_bitwidth > 8:
            import torch
            wide = src if src.dtype.scalar == fp32 else self.cast_impl(src, fp32)
            values = torch.from_numpy(np.ascontiguousarray(wide.data, dtype=np.float32)).clamp(-448.0, 448.0)
            return interpreter.TensorHandle(values.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), dst_type.scalar)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    interpreter._patch_lang_tensor = patched_lang_tensor
    builder.create_dot = patched_create_dot
    builder.cast_impl = patched_cast_impl
    builder.create_fp_to_fp = patched_fp_to_fp
    interpreter.specserve_fixed = True
