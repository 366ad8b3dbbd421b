"""Build the CPU quantized-GEMM extension ahead of time (the Makefile's setup step runs this).

    python -m specserve.kernels.build
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    from specserve.layers.quant_cpu import build_extension, cpu_has_avx2_fma, extension_build_dir

    start = time.perf_counter()
    try:
        ext = build_extension()
    except Exception as exc:
        # Not fatal: the engine falls back to fp32 weights and serves as before, only slower.
        print(f"specserve: building the CPU quantized-GEMM kernel failed ({exc}); fp32 weights will be used",
              file=sys.stderr)
        return 0
    print(f"specserve: CPU quantized-GEMM kernel built in {extension_build_dir()} "
          f"({time.perf_counter() - start:.1f}s; AVX2+FMA: {ext.built_with_avx2()}, CPU has AVX2+FMA: "
          f"{cpu_has_avx2_fma()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
