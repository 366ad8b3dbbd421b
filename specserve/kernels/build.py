"""Build the CPU kernels ahead of time (the Makefile's setup step runs this), so that the first request
or test does not wait for the compiler.

    python -m specserve.kernels.build

A kernel that fails to build is reported and skipped: the engine then uses the plain-torch path for it.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    from specserve.kernels.loader import cpu_has_avx2_fma
    from specserve.layers.cpu_attention import build_attention_extension
    from specserve.layers.cpu_ops import build_ops_extension
    from specserve.layers.quant_cpu import build_extension

    print(f"specserve: building CPU kernels (AVX2+FMA: {cpu_has_avx2_fma()})", flush=True)
    for name, build in (("block-quantized GEMM", build_extension), ("paged attention", build_attention_extension),
                        ("fused elementwise ops", build_ops_extension)):
        start = time.perf_counter()
        try:
            build()
        except Exception as exc:  # not fatal: the engine falls back to torch for this kernel
            print(f"specserve: {name} kernel failed to build ({exc}); the torch path will be used", file=sys.stderr)
            continue
        print(f"specserve: {name} kernel ready ({time.perf_counter() - start:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
