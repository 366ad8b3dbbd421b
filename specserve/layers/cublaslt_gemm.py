"""16-bit GEMMs of verify-sized steps through cuBLASLt with an algorithm configuration chosen by measurement
(``quant_tiles.BF16_LT_ALGOS``) instead of the heuristic's first choice, which is what torch's cuBLAS call runs.

Why: at 256 rows (a verify step of 32 sequences x 8 tokens) the Llama-3.1-8B projections are compute-bound, and
configurations the heuristic does not offer run them faster on an H200: o_proj x1.20, down x1.08, qkv x1.09,
gate_up x1.04 (``benchmarks/cublaslt_algos_gpu.py --search-max``, ``results/cublaslt_search_h200.json``), while at
decode sizes the heuristic's choice is already the best (``cublaslt_search_32_h200.json``). The bindings are
NVIDIA's nvmath-python (the optional ``gpu`` extra); without it, or where ``cublasLtMatmulAlgoCheck`` rejects a
configuration, the layer keeps torch's call.

The product is posed as torch poses it to cuBLAS: column-major operands, D^T [N, M] = op_T(A) @ B, A = the weight
``w`` [N, K] row-major read as the column-major [K, N] matrix W^T (op_T makes it W), B = ``x`` [M, K] row-major
read as the column-major [K, M] matrix x^T, so D^T column-major is ``x @ w.T`` row-major; fp32 accumulation and
scales, one rounding to 16 bits.

Worked example (M = 2, N = 3, K = 4): ``w`` row-major [3, 4] is column-major [4, 3] (column j = row j of ``w``);
op_T makes it [3, 4]; ``x`` row-major [2, 4] is column-major [4, 2]; their product is [3, 2] column-major, whose
memory is the row-major [2, 3] matrix ``x @ w.T``.
"""

from __future__ import annotations

import logging
import weakref

import torch

logger = logging.getLogger(__name__)

# cudaDataType_t codes
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
DATA_TYPES = {torch.float16: CUDA_R_16F, torch.bfloat16: CUDA_R_16BF}
WORKSPACE_BYTES = 4 << 20
# algorithm configuration fields a table entry may set (cublasLtMatmulAlgoConfigAttributes_t names, lower case)
CONFIG_FIELDS = ("tile_id", "stages_id", "splitk_num", "reduction_scheme", "cta_swizzling", "custom_option",
                 "inner_shape_id", "cluster_shape_id")


def bindings():
    """nvmath-python's cuBLASLt module, or None where it is not installed (or fails to load)."""
    try:
        from nvmath.bindings import cublasLt
    except Exception:  # noqa: BLE001 - any import failure means: keep torch's calls
        return None
    return cublasLt


def entry_for(
    entries: list[tuple[int, int, dict]],  # (lo, hi, config)
    m: int,
) -> dict | None:
    """The configuration of the first entry serving ``lo < m <= hi``, else None."""
    return next((cfg for lo, hi, cfg in entries if lo < m <= hi), None)


def served_layers(
    model: torch.nn.Module,
    table: dict[tuple[int, int], list],  # (N, K) -> entries
) -> list:
    """The ``Linear`` layers of ``model`` a table serves: plain (no subclass), bias-free, no GGUF blocks, a 16-bit
    weight whose (N, K) shape has entries."""
    from specserve.layers.linear import Linear
    return [m for m in model.modules() if type(m) is Linear and m.bias is None and m.quant is None
            and m.weight.dtype in DATA_TYPES and tuple(m.weight.shape) in table]


def matmul_desc(lt) -> tuple[int, object]:
    """A cuBLASLt matmul descriptor with fp32 compute and scales and op_T on A (the weight: module docstring) ->
    (descriptor, the TRANSA value's buffer, which the caller keeps alive with it)."""
    import numpy as np
    from nvmath.bindings import cublas
    desc = lt.matmul_desc_create(int(cublas.ComputeType.COMPUTE_32F), CUDA_R_32F)
    transa = np.array([int(cublas.Operation.T)], dtype=np.int32)
    lt.matmul_desc_set_attribute(desc, int(lt.MatmulDescAttribute.TRANSA), transa.ctypes.data, transa.itemsize)
    return desc, transa


def set_algo_config(lt, algo, cfg: dict) -> None:
    """Write ``cfg``'s ``CONFIG_FIELDS`` into ``algo`` (a one-record numpy array of ``lt.matmul_algo_dtype``)."""
    import numpy as np
    for name in CONFIG_FIELDS:
        if name in cfg:
            attr = int(getattr(lt.MatmulAlgoConfigAttribute, name.upper()))
            buf = np.array([cfg[name]], dtype=lt.get_matmul_algo_config_attribute_dtype(attr))
            lt.matmul_algo_config_set_attribute(algo.ctypes.data, attr, buf.ctypes.data, buf.itemsize)


def _destroy(lt, desc: int, layouts: list[int]) -> None:
    for layout in layouts:
        lt.matrix_layout_destroy(layout)
    lt.matmul_desc_destroy(desc)


class LtContext:
    """One cuBLASLt handle and workspace on ``device``, shared by a model's ``LtGemm``s (one stream at a time)."""

    def __init__(self, device: torch.device) -> None:
        import numpy as np
        self.lt, self.np = bindings(), np
        with torch.cuda.device(device):
            self.handle = self.lt.create()
        weakref.finalize(self, self.lt.destroy, self.handle)  # the handle goes with the last LtGemm using it
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.alpha = np.array([1.0], dtype=np.float32)
        self.beta = np.array([0.0], dtype=np.float32)


class LtGemm:
    """``x @ w.T`` for one weight shape (``n`` x ``k``, ``dtype``) with the configuration of the table entry whose
    row range holds x's row count; ``__call__`` returns None for other row counts (and for a count whose
    configuration cuBLASLt rejects), and the caller runs torch's call."""

    def __init__(self, ctx: LtContext, n: int, k: int, dtype: torch.dtype,
                 entries: list[tuple[int, int, dict]]) -> None:  # (lo, hi, config): serves lo < M <= hi
        lt = ctx.lt
        self.ctx, self.n, self.k, self.dtype, self.entries = ctx, n, k, dtype, entries
        self.desc, self._transa = matmul_desc(lt)
        self.a_layout = lt.matrix_layout_create(DATA_TYPES[dtype], k, n, k)
        self.plans: dict[int, tuple | None] = {}  # rows -> (b_layout, d_layout, algo, workspace bytes) | None
        self._layouts: list[int] = [self.a_layout]  # every layout made, destroyed with the descriptor
        weakref.finalize(self, _destroy, lt, self.desc, self._layouts)

    def config_for(self, m: int) -> dict | None:
        return entry_for(self.entries, m)

    def plan(self, m: int) -> tuple | None:
        """Layouts and checked algorithm for ``m`` rows, made once (None: no entry, or cuBLASLt rejects it)."""
        if m in self.plans:
            return self.plans[m]
        from nvmath.bindings import cublas
        lt, np, cfg = self.ctx.lt, self.ctx.np, self.config_for(m)
        plan = None
        if cfg is not None:
            code = DATA_TYPES[self.dtype]
            b_layout = lt.matrix_layout_create(code, self.k, m, self.k)
            d_layout = lt.matrix_layout_create(code, self.n, m, self.n)
            self._layouts += [b_layout, d_layout]
            algo = np.zeros(1, dtype=lt.matmul_algo_dtype)
            check = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
            try:  # an algorithm or field this GPU / cuBLASLt lacks, or a rejected configuration: torch's call
                lt.matmul_algo_init(self.ctx.handle, int(cublas.ComputeType.COMPUTE_32F), CUDA_R_32F, code, code,
                                    code, code, int(cfg["id"]), algo.ctypes.data)
                set_algo_config(lt, algo, cfg)
                lt.matmul_algo_check(self.ctx.handle, self.desc, self.a_layout, b_layout, d_layout, d_layout,
                                     algo.ctypes.data, check.ctypes.data)
                workspace = int(check[0]["workspace_size"])
                if workspace <= WORKSPACE_BYTES:
                    plan = (b_layout, d_layout, algo, workspace)
            except Exception:  # noqa: BLE001
                plan = None
        self.plans[m] = plan
        return plan

    def vet(
        self,
        w: torch.Tensor,  # [N, K]: a weight this GEMM will serve
        tolerance: float = 1 / 64,
    ) -> bool:
        """Run each entry's largest row count once on random rows against torch's call (``F.linear``), before any
        graph is captured: True when every served count agrees to within ``tolerance`` x the largest output (a few
        bf16 rounding steps: the sums' order differs) and cuBLASLt accepted at least one; a configuration that
        fails is dropped (its rows keep torch's call)."""
        import torch.nn.functional as F
        gen = torch.Generator(device=w.device).manual_seed(0)
        served = False
        for i, (_, hi, _) in enumerate(self.entries):
            x = torch.randn(hi, self.k, device=w.device, dtype=self.dtype, generator=gen)
            got = self(x, w)
            if got is None:
                continue
            want = F.linear(x, w).float()
            if (got.float() - want).abs().max().item() <= tolerance * want.abs().max().item():
                served = True
            else:
                self.entries = [e for j, e in enumerate(self.entries) if j != i]
                self.plans.clear()
                return self.vet(w, tolerance)
        return served

    def __call__(
        self,
        x: torch.Tensor,  # [M, K], contiguous, self.dtype, on the context's device
        w: torch.Tensor,  # [N, K], contiguous, self.dtype
    ) -> torch.Tensor | None:  # [M, N], x.dtype; None: not served here
        if (x.dim() != 2 or x.dtype != self.dtype or not x.is_contiguous() or not w.is_contiguous()
                or x.shape[1] != self.k or tuple(w.shape) != (self.n, self.k)):
            return None
        m = x.shape[0]
        plan = self.plan(m) if m > 0 else None
        if plan is None:
            return None
        b_layout, d_layout, algo, workspace = plan
        out = torch.empty(m, self.n, dtype=x.dtype, device=x.device)
        ctx = self.ctx
        ctx.lt.matmul(ctx.handle, self.desc, ctx.alpha.ctypes.data, w.data_ptr(), self.a_layout, x.data_ptr(),
                      b_layout, ctx.beta.ctypes.data, out.data_ptr(), d_layout, out.data_ptr(), d_layout,
                      algo.ctypes.data, ctx.workspace.data_ptr(), workspace,
                      torch.cuda.current_stream(x.device).cuda_stream)
        return out


def attach(
    model: torch.nn.Module,
    table: dict[tuple[int, int], list[tuple[int, int, dict]]],  # (N, K) -> [(lo, hi, config)]
    device: torch.device,
) -> int:
    """Give every bias-free 16-bit ``Linear`` of ``model`` whose weight shape has a ``table`` entry an ``LtGemm``
    (``Linear.lt``), sharing one ``LtContext``, once ``LtGemm.vet`` has checked it against torch's call on the
    layer's own weight; returns how many got one (0 off CUDA, without nvmath-python or matching layers)."""
    if device.type != "cuda" or not table:
        return 0
    layers = served_layers(model, table)
    if not layers:
        return 0
    if bindings() is None:
        logger.warning("cuBLASLt configurations unused: nvmath-python is not installed (pip install '.[gpu]'); "
                       "%d projections keep torch's cuBLAS call", len(layers))
        return 0
    try:
        ctx = LtContext(device)
    except Exception as exc:  # noqa: BLE001 - cuBLASLt unusable here: every layer keeps torch's call
        logger.warning("cuBLASLt configurations unused: %s", exc)
        return 0
    gemms: dict[tuple, LtGemm] = {}
    for layer in layers:
        key = (*layer.weight.shape, layer.weight.dtype)
        if key not in gemms:
            gemms[key] = LtGemm(ctx, *layer.weight.shape, layer.weight.dtype, table[tuple(layer.weight.shape)])
        layer.lt = gemms[key]
    vetted = {key: gemm.vet(next(m.weight for m in layers if m.lt is gemm)) for key, gemm in gemms.items()}
    kept = [m for m in layers if vetted[(*m.weight.shape, m.weight.dtype)]]
    for layer in layers:
        if layer not in kept:
            layer.lt = None
    return len(kept)
