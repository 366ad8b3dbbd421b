"""Every cuBLASLt algorithm that its heuristic offers for the Llama-3.1-8B step GEMMs at decode (32 rows: batch 32)
and verify (256 rows: batch 32 x 8 query tokens) shapes, timed against the cuBLAS call torch makes, side by side in
one run (GPU machine, not CI).

Why: issue 6's verify8_vs_decode_b32 is 1.44 on the H200 (bar 1.40) and the verify step is GEMM-bound. At 256 rows
cuBLAS runs gate_up as 224 tiles of 256x128 on 132 SMs (1.7 waves: 85% of the SMs busy in the second), and qkv and
o_proj at 510-585 TFLOP/s. torch asks cuBLAS for its heuristic's first choice only; cuBLASLt's heuristic offers
more candidates (other tiles, split-K and reduction schemes, cluster shapes). Our own Triton GEMMs, stream-K
included, lost to cuBLAS at these shapes (triton_gemm_*gpu.json), and torch's BLAS settings moved decode and verify
alike (verify_gemm_gpu.json). This asks whether another cuBLASLt candidate wins.

How: each (shape, rows) problem is posed to cuBLASLt as torch poses it to cuBLAS (``LtProblem``: column-major,
op_T on the weight, fp32 accumulation) through nvmath-python's low-level cuBLASLt bindings (NVIDIA's; carried as a
wheel to the GPU machine), and its heuristic asked for up to ``--limit`` candidates. Each candidate is timed as raw
``cublasLtMatmul`` calls captured in a CUDA graph (the way the engine replays its steps): ``--reps`` passes over
several weight copies (>= 400 MB in all, so weights stream from HBM as in a forward), median of 5 replays, per
call. torch's call (``F.linear``; for the LM head ``torch.mm(out_dtype=float32)``, as ``dense_linear`` calls them)
is timed the same way in the same process. Each candidate's output is compared with torch's.

    python benchmarks/cublaslt_algos_gpu.py --out $OUT/cublaslt_algos_gpu.json

Asserts nothing; prints a table per problem and writes JSON (per candidate: id, tile, stages, split-K, reduction
scheme, cluster shape, the heuristic's waves estimate, microseconds, error against torch).

``--search-max N`` also times up to N configurations beyond the heuristic's for the ``--search-problems``
(``LtProblem.search``: every tile of the heuristic's algorithm x cluster shape x custom option that
``cublasLtMatmulAlgoCheck`` accepts; the heuristic's tiles first, then the best-filled waves, then larger tiles).
``--check-table`` runs only the committed ``quant_tiles.BF16_LT_ALGOS`` through the engine's own
``layers/cublaslt_gemm.LtGemm`` against torch's call (output difference and time).

Reading (stop 40, one H100 run, heuristic candidates only: ``results/cublaslt_algos_h100.json``): the heuristic
offers 8 candidates per problem, all of algorithm 66 (the nvjet kernels), and its first times as torch's call does
(within 1 us everywhere). The best candidate beats it by x1.00-1.07: qkv at 32 rows x1.07, down at 256 rows
x1.056, the LM head x1.05 / x1.03 at 32 / 256 rows, gate_up at 256 rows x1.014. Summed over a step's GEMMs: 5.73 ->
5.66 ms at 32 rows, 6.89 -> 6.74 ms at 256 (GEMM-only verify / decode 1.203 -> 1.190). Those fractions applied to
the H200's steps would move verify8_vs_decode_b32 from 1.444 to about 1.43, a third of the 0.044 the bar needs, for
a new dependency and per-GPU algorithm tables: not adopted.

Reading (stop 41, H200, ``--search-max 100``: ``results/cublaslt_search_h200.json``, ``_32_h200``, ``_head_h200``):
beyond the heuristic's 8 candidates the search found faster configurations at 256 rows, all of algorithm 66 with
split-K 1: o_proj 17.5 -> 14.5 us (x1.20, TILE_128x64, cluster id 2), down 48.2 -> 44.5 (x1.08, the same tile;
outputs one bf16 rounding step apart), qkv 21.6 -> 19.9 (x1.09, TILE_96x128, custom option 4), gate_up 89.1 ->
86.0 (x1.04, TILE_112x128, custom option 2, cluster id 5): 11.5 us a layer, 0.37 ms over a verify step's 32 layers
(the LM head x1.015). At 32 rows the heuristic's first choice stayed the fastest (x1.00). Those configurations are
``quant_tiles.BF16_LT_ALGOS``, run by ``layers/cublaslt_gemm.py`` when ``EngineConfig.cublaslt_algos`` is on (off
until the engine's verify step is timed with them: ``gpu_engine.py --cublaslt-algos``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from benchmarks.triton_gemm_gpu import gemm_operands, llama8b_shapes, time_calls  # noqa: E402
from specserve.layers.cublaslt_gemm import CUDA_R_16BF, CUDA_R_32F, matmul_desc, set_algo_config  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402

SHAPES = llama8b_shapes()  # name -> (out_features, in_features, float32 output): Llama-3.1-8B
LAYERS = shape_config("llama-3.1-8b").num_hidden_layers
PER_STEP = {name: 1 if name == "lm_head" else LAYERS for name in SHAPES}  # calls of each GEMM in one step

CONFIG_FIELDS = ("ID", "TILE_ID", "STAGES_ID", "SPLITK_NUM", "REDUCTION_SCHEME", "CTA_SWIZZLING", "CUSTOM_OPTION",
                 "INNER_SHAPE_ID", "CLUSTER_SHAPE_ID")
WORKSPACE_BYTES = 32 << 20


class LtProblem:
    """``x @ w.T`` posed to cuBLASLt the way torch poses it to cuBLAS: column-major operands, D^T [N, M] = op_T(A)
    @ B with A = ``w`` read as a column-major [K, N] matrix (transposed by the op) and B = ``x`` read as a
    column-major [K, M] matrix, so that D^T column-major is ``x @ w.T`` row-major; fp32 accumulation and scales.

    Worked example (M = 2, N = 3, K = 4): ``w`` row-major [3, 4] is the column-major [4, 3] matrix W^T (column j =
    row j of ``w``); op_T makes it W [3, 4]; ``x`` row-major [2, 4] is the column-major [4, 2] matrix x^T; W @ x^T
    is [3, 2] column-major, whose memory is the row-major [2, 3] matrix x @ W^T."""

    def __init__(self, m: int, n: int, k: int, float_out: bool, limit: int) -> None:
        import numpy as np
        from nvmath.bindings import cublasLt as lt
        self.lt, self.np = lt, np
        bf16, f32 = CUDA_R_16BF, CUDA_R_32F
        self.handle = lt.create()
        self.desc, self._transa = matmul_desc(lt)
        self.a_layout = lt.matrix_layout_create(bf16, k, n, k)
        self.b_layout = lt.matrix_layout_create(bf16, k, m, k)
        self._d_type = f32 if float_out else bf16
        self.d_layout = lt.matrix_layout_create(self._d_type, n, m, n)
        self.pref = lt.matmul_preference_create()
        self._ws = np.array([WORKSPACE_BYTES], dtype=np.uint64)
        lt.matmul_preference_set_attribute(self.pref, int(lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES),
                                           self._ws.ctypes.data, 8)
        self.results = np.zeros(limit, dtype=lt.matmul_heuristic_result_dtype)
        count = np.zeros(1, dtype=np.int32)
        lt.matmul_algo_get_heuristic(self.handle, self.desc, self.a_layout, self.b_layout, self.d_layout,
                                     self.d_layout, self.pref, limit, self.results.ctypes.data, count.ctypes.data)
        self.count = int(count[0])
        self.alpha = np.array([1.0], dtype=np.float32)
        self.beta = np.array([0.0], dtype=np.float32)

    def algo_ptr(self, i: int) -> int:
        return self.results.ctypes.data + i * self.results.dtype.itemsize + self.results.dtype.fields["algo"][1]

    def describe(self, i: int) -> dict:
        """Candidate ``i``'s configuration (algorithm id, tile, stages, split-K, ...) and the heuristic's
        workspace and waves estimates."""
        lt, np = self.lt, self.np
        out = {"workspace_size": int(self.results[i]["workspace_size"]),
               "waves_count": float(self.results[i]["waves_count"]), "state": int(self.results[i]["state"])}
        for name in CONFIG_FIELDS:
            try:
                attr = int(getattr(lt.MatmulAlgoConfigAttribute, name))
                buf = np.zeros(1, dtype=lt.get_matmul_algo_config_attribute_dtype(attr))
                written = np.zeros(1, dtype=np.uint64)
                lt.matmul_algo_config_get_attribute(self.algo_ptr(i), attr, buf.ctypes.data, buf.itemsize,
                                                    written.ctypes.data)
                out[name.lower()] = int(buf[0])
            except Exception as exc:  # noqa: BLE001 - an attribute this cuBLASLt lacks
                out[name.lower()] = f"{type(exc).__name__}"
        out["tile"] = self.tile_name(out.get("tile_id"))
        return out

    def tile_name(self, tile_id) -> str:
        """``TILE_256x128`` for a tile id (cuBLASLt's ``cublasLtMatmulTile_t``), else the id as text."""
        try:
            return self.lt.MatmulTile(int(tile_id)).name
        except Exception:  # noqa: BLE001 - an id this enum does not name
            return str(tile_id)

    def tile_area(self, tile_id: int) -> int:
        """Rows x columns of a tile id's output tile (0 when its name does not say)."""
        try:
            m, n = self.tile_name(tile_id).removeprefix("TILE_").split("x")[:2]
            return int(m) * int(n)
        except ValueError:
            return 0

    def call(
        self,
        i: int,
        x: torch.Tensor,  # [M, K] bf16, row-major
        w: torch.Tensor,  # [N, K] bf16, row-major
        d: torch.Tensor,  # [M, N] bf16 (float32 with float_out), row-major: written
        workspace: torch.Tensor,  # [WORKSPACE_BYTES] uint8
    ):
        """A no-argument raw ``cublasLtMatmul`` with candidate ``i`` of ``x @ w.T`` into ``d`` ([M, N] row-major),
        on the current torch stream (so that a CUDA graph captures it)."""
        ws_size = int(self.results[i]["workspace_size"])
        algo = self.algo_ptr(i)

        def run() -> None:
            self.lt.matmul(self.handle, self.desc, self.alpha.ctypes.data, w.data_ptr(), self.a_layout, x.data_ptr(),
                           self.b_layout, self.beta.ctypes.data, d.data_ptr(), self.d_layout, d.data_ptr(),
                           self.d_layout, algo, workspace.data_ptr(), ws_size, torch.cuda.current_stream().cuda_stream)
        return run

    def search(self, heuristic_tiles: set[int], max_timed: int) -> None:
        """Configurations of the heuristic's algorithm(s) beyond its candidates: every tile of each algorithm id
        the heuristic used x cluster shape x custom option (split-K 1, the heuristic's stage id), kept when
        ``cublasLtMatmulAlgoCheck`` accepts it; up to ``max_timed`` of them: tiles the heuristic offered for any
        problem first, then those whose waves use the SMs best, then larger tiles. Appended after the heuristic's
        candidates (``results``), so ``call`` and ``describe`` take their indices too."""
        lt, np = self.lt, self.np
        from nvmath.bindings import cublas
        bf16 = CUDA_R_16BF
        d_type = self._d_type
        described = [self.describe(i) for i in range(self.count)]
        ids = sorted({int(d["id"]) for d in described})
        stages = int(described[0]["stages_id"]) if described else 0
        found = []
        check = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
        for algo_id in ids:
            base = np.zeros(1, dtype=lt.matmul_algo_dtype)
            lt.matmul_algo_init(self.handle, int(cublas.ComputeType.COMPUTE_32F), CUDA_R_32F, bf16, bf16, d_type,
                                d_type, algo_id, base.ctypes.data)
            tiles = self._cap_array(base, "TILE_IDS")
            co_max = max(self._cap_array(base, "CUSTOM_OPTION_MAX"), default=0)
            for tile in tiles:
                for cluster in (0, 2, 3, 4, 5, 6, 7, 9):
                    for co in range(co_max + 1):
                        algo = base.copy()
                        set_algo_config(lt, algo, {"tile_id": tile, "stages_id": stages, "splitk_num": 1,
                                                   "cluster_shape_id": cluster, "custom_option": co})
                        try:
                            lt.matmul_algo_check(self.handle, self.desc, self.a_layout, self.b_layout, self.d_layout,
                                                 self.d_layout, algo.ctypes.data, check.ctypes.data)
                        except Exception:  # noqa: BLE001, S112 - not supported for this problem
                            continue
                        waves = float(check[0]["waves_count"])
                        if waves <= 0 or int(check[0]["workspace_size"]) > WORKSPACE_BYTES:
                            continue
                        efficiency = waves / np.ceil(waves)
                        found.append((int(tile) not in heuristic_tiles, -round(efficiency, 2),
                                      -self.tile_area(tile), len(found), algo, check.copy()))
        found.sort(key=lambda f: f[:4])
        chosen = found[:max_timed]
        extra = np.zeros(self.count + len(chosen), dtype=lt.matmul_heuristic_result_dtype)
        extra[:self.count] = self.results[:self.count]
        for j, (*_, algo, res) in enumerate(chosen):
            extra[self.count + j] = res[0]
            extra["algo"][self.count + j] = algo[0]  # field first: a view of ``extra``, written in place
        self.results = extra
        self.searched = {"configs_accepted": len(found), "timed": len(chosen)}

    def _cap_array(self, algo, name: str):
        lt, np = self.lt, self.np
        attr = int(getattr(lt.MatmulAlgoCapAttribute, name))
        dt = np.dtype(lt.get_matmul_algo_cap_attribute_dtype(attr))
        written = np.zeros(1, dtype=np.uint64)
        lt.matmul_algo_cap_get_attribute(algo.ctypes.data, attr, 0, 0, written.ctypes.data)
        n = max(int(written[0]) // dt.itemsize, 1)
        buf = np.zeros(n, dtype=dt)
        lt.matmul_algo_cap_get_attribute(algo.ctypes.data, attr, buf.ctypes.data, buf.nbytes, written.ctypes.data)
        return [int(v) for v in buf[:int(written[0]) // dt.itemsize]]

    def free(self) -> None:
        lt = self.lt
        lt.matmul_preference_destroy(self.pref)
        for layout in (self.a_layout, self.b_layout, self.d_layout):
            lt.matrix_layout_destroy(layout)
        lt.matmul_desc_destroy(self.desc)
        lt.destroy(self.handle)


def problem(name: str, n: int, k: int, float_out: bool, m: int, device: torch.device, reps: int,
            limit: int, search_max: int = 0, tiles_seen: set[int] | None = None) -> dict:
    """Time torch's call and every cuBLASLt candidate for ``x [m, k] @ w.T`` (``w`` [n, k]); with ``search_max``,
    also up to that many configurations beyond the heuristic's (``LtProblem.search``)."""
    dtype = torch.bfloat16
    weights, x = gemm_operands(n, k, m, device, n + k + m)
    copies = len(weights)

    def torch_call(w):
        return (lambda: torch.mm(x, w.t(), out_dtype=torch.float32)) if float_out else (lambda: F.linear(x, w))

    row = {"name": name, "n": n, "k": k, "m": m, "copies": copies, "float_out": float_out}
    row["torch_us"] = time_calls([torch_call(w) for w in weights], reps) * 1e6
    ref = torch_call(weights[-1])().float()
    lt = LtProblem(m, n, k, float_out, limit)
    row["num_candidates"] = lt.count
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    d = torch.empty(m, n, device=device, dtype=torch.float32 if float_out else dtype)
    cands = [{"rank": i, "source": "heuristic"} | lt.describe(i) for i in range(lt.count)]
    tiles_seen = set() if tiles_seen is None else tiles_seen
    tiles_seen |= {int(c["tile_id"]) for c in cands}
    if search_max > 0:
        try:
            lt.search(tiles_seen, search_max)
            row["search"] = lt.searched
            cands += [{"rank": i, "source": "search"} | lt.describe(i) for i in range(lt.count, len(lt.results))]
        except Exception as exc:  # noqa: BLE001 - keep the heuristic's candidates
            row["search_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    for entry in cands:
        rank = entry["rank"]
        try:
            entry["us"] = time_calls([lt.call(rank, x, w, d, workspace) for w in weights], reps) * 1e6
            got = d.float()  # the last call's product: weights[-1]
            entry["max_abs_err_vs_torch"] = (got - ref).abs().max().item()
            entry["ref_max_abs"] = ref.abs().max().item()
        except Exception as exc:  # noqa: BLE001 - record it, time the others
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    row["candidates"] = cands
    timed = [c for c in cands if "us" in c]
    if timed:
        best = min(timed, key=lambda c: c["us"])
        row["best"] = best
        row["best_vs_torch"] = row["torch_us"] / best["us"]
        row["heuristic_first_us"] = timed[0]["us"] if timed[0]["rank"] == 0 else None
        flop = 2 * m * n * k
        row["tflop_s"] = {"torch": flop / row["torch_us"] / 1e6, "best": flop / best["us"] / 1e6}
    lt.free()
    del weights, workspace, d
    ge.free(device)
    return row


def check_table(device: torch.device, reps: int) -> list[dict]:
    """Each ``quant_tiles.BF16_LT_ALGOS`` entry through the engine's own ``cublaslt_gemm.LtGemm`` at its largest
    row count, against torch's call on the same operands: output difference and time (as ``problem`` times)."""
    from specserve.layers import cublaslt_gemm, quant_tiles
    ctx = cublaslt_gemm.LtContext(device)
    rows = []
    for (n, k), entries in quant_tiles.BF16_LT_ALGOS.items():
        for _, hi, cfg in entries:
            weights, x = gemm_operands(n, k, hi, device, n + k)
            gemm = cublaslt_gemm.LtGemm(ctx, n, k, torch.bfloat16, entries)
            got, want = gemm(x, weights[0]), F.linear(x, weights[0])
            row = {"n": n, "k": k, "rows": hi, "config": cfg, "served": got is not None}
            if got is not None:
                row["max_abs_diff"] = (got.float() - want.float()).abs().max().item()
                row["torch_us"] = time_calls([lambda w=w, x=x: F.linear(x, w) for w in weights], reps) * 1e6
                row["lt_us"] = time_calls([lambda w=w, x=x, g=gemm: g(x, w) for w in weights], reps) * 1e6
                row["speedup"] = row["torch_us"] / row["lt_us"]
            print(json.dumps(row), flush=True)
            rows.append(row)
            del weights
            ge.free(device)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--limit", type=int, default=64, help="candidates asked of the cuBLASLt heuristic")
    ap.add_argument("--search-max", type=int, default=0,
                    help="also time up to this many configurations beyond the heuristic's (LtProblem.search)")
    ap.add_argument("--search-problems", default="qkv.256,o.256,gate_up.256,down.256",
                    help="name.rows problems that get the search")
    ap.add_argument("--check-table", action="store_true",
                    help="only: quant_tiles.BF16_LT_ALGOS through the engine's LtGemm against torch (check_table)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    t0 = time.perf_counter()
    import nvmath
    from nvmath.bindings import cublasLt
    data: dict = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(device),
                  "torch": torch.__version__, "cuda": torch.version.cuda, "nvmath": nvmath.__version__,
                  "cublaslt_version": cublasLt.get_version(),
                  "torch_blas": str(torch.backends.cuda.preferred_blas_library()),
                  "allow_bf16_reduced_precision_reduction":
                      torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
                  "definitions": {
                      "torch_us / us": "microseconds per call inside a CUDA graph of --reps passes over weight "
                                       "copies (>= 400 MB in all: HBM, not L2), median of 5 replays",
                      "rank": "the candidate's place in the cuBLASLt heuristic's order (0 = its first choice)",
                      "step_ms": "sum over one step's GEMMs (32 layers x qkv, o, gate_up, down + the LM head)"},
                  "problems": [], "errors": {}}
    if args.check_table:
        data["table_check"] = check_table(device, args.reps)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(data, indent=1))
        return 0
    rows = [int(r) for r in args.rows.split(",")]
    tiles_seen: set[int] = set()
    wanted = set(args.shapes.split(","))
    for m in rows:
        for name, (n, k, float_out) in SHAPES.items():
            if name not in wanted:
                continue
            try:
                search = args.search_max if f"{name}.{m}" in args.search_problems.split(",") else 0
                r = problem(name, n, k, float_out, m, device, args.reps, args.limit, search, tiles_seen)
            except Exception as exc:  # noqa: BLE001 - one problem's failure must not lose the others
                data["errors"][f"{name}.m{m}"] = f"{type(exc).__name__}: {str(exc)[:500]}"
                print(f"{name} m={m}: {data['errors'][f'{name}.m{m}']}", flush=True)
                continue
            data["problems"].append(r)
            b = r.get("best", {})
            print(f"{name:8s} m={m:3d}: torch {r['torch_us']:8.1f} us; {r['num_candidates']:2d} cuBLASLt candidates,"
                  f" first {r.get('heuristic_first_us') or float('nan'):8.1f} us, best {b.get('us', float('nan')):8.1f}"
                  f" us (x{r.get('best_vs_torch', float('nan')):.3f}; rank {b.get('rank')}, id {b.get('id')}, tile"
                  f" {b.get('tile')}, split_k {b.get('splitk_num')}, waves {b.get('waves_count')},"
                  f" err {b.get('max_abs_err_vs_torch')})", flush=True)
    steps = {}
    for m in rows:
        got = {r["name"]: r for r in data["problems"] if r["m"] == m}
        if set(got) == set(SHAPES):
            steps[str(m)] = {
                "torch_ms": sum(PER_STEP[nm] * r["torch_us"] for nm, r in got.items()) / 1e3,
                "best_ms": sum(PER_STEP[nm] * r["best"]["us"] for nm, r in got.items()) / 1e3}
    data["step_ms"] = steps
    if {"32", "256"} <= set(steps):
        data["gemm_verify_vs_decode"] = {key: steps["256"][key] / steps["32"][key] for key in ("torch_ms", "best_ms")}
    data["total_seconds"] = time.perf_counter() - t0
    print(json.dumps({"step_ms": steps, "gemm_verify_vs_decode": data.get("gemm_verify_vs_decode")}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
