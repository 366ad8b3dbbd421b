"""Run Triton kernels on CPU under Triton's interpreter, with the two interpreter bugs of Triton 3.6 patched.

``triton.jit`` decides between compiling and interpreting when a kernel is *defined*, from ``TRITON_INTERPRET``,
so it must be set before triton is first imported (``reload_interpreted`` re-imports a kernel module that
was imported earlier without it). Used by the Triton kernel tests (attention, W4A16, CUDA-graph paths).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def reload_interpreted(module: ModuleType, kernel_name: str) -> ModuleType:
    """``module`` with its kernels interpreted (reloaded if ``kernel_name`` was compiled for a GPU)."""
    from triton.runtime import interpreter
    if not isinstance(getattr(module, kernel_name), interpreter.InterpretedFunction):
        module = importlib.reload(module)
    return module


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
    """Three bugs of Triton 3.6's interpreter (not of the compiled path), patched for tests only:

    - it keeps a scalar as a 1-element array and turns it into a loop bound with ``int(array)``, which
      NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars",
      triton-lang/triton#9171, fixed upstream by #9172 after 3.6.0): take the one element instead;
    - it stores bfloat16 as raw uint16 bits and ``tl.dot`` multiplies those bits as integers: widen bfloat16
      operands to float32 first (what the tensor cores' fp32 accumulation computes, up to summation order);
    - its float32 -> bfloat16 cast truncates, and its float -> float8 downcast truncates e4m3's subnormals and
      rounds ties up: convert with torch instead (round to nearest even, as the GPU does; float8 saturated to
      +-448 as ``cvt.rn.satfinite`` does).
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

    def patched_cast_impl(self, src, dst_type):
        if src.dtype.scalar == triton.language.float32 and dst_type.scalar == triton.language.bfloat16:
            import numpy as np
            import torch
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return interpreter.TensorHandle(values.to(torch.bfloat16).view(torch.uint16).numpy(), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    create_fp_to_fp = builder.create_fp_to_fp

    def patched_create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != triton.language.float8e4nv or src.dtype.scalar.primitive_bitwidth <= 8:
            return create_fp_to_fp(self, src, dst_type, rounding_mode)
        import numpy as np
        import torch
        wide = src if src.dtype.scalar == triton.language.float32 else self.cast_impl(src, triton.language.float32)
        values = torch.from_numpy(np.ascontiguousarray(wide.data, dtype=np.float32)).clamp(-448.0, 448.0)
        bits = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return interpreter.TensorHandle(bits, dst_type.scalar)

    interpreter._patch_lang_tensor = patched_lang_tensor
    builder.create_dot = patched_create_dot
    builder.create_fp_to_fp = patched_create_fp_to_fp
    builder.cast_impl = patched_cast_impl
    interpreter.specserve_fixed = True
