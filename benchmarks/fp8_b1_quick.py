"""FP8 against bf16 engine decode steps at batch 1 on the Llama-3.1-8B shape (dummy weights), alone: the
``quantized`` section of ``gpu_engine.py`` (same helpers, same definitions) for bf16 and fp8 only, when there
is not enough device time for the whole script. GPU machine, not CI.

    python benchmarks/fp8_b1_quick.py                    # writes $OUT/fp8_b1.json
    python benchmarks/fp8_b1_quick.py --fuse-act-quant   # fp8 twice: quantizer launched alone, then fused
    python benchmarks/fp8_b1_quick.py --fuse-act-quant --fused-mlp '{"bn1": 8, ..., "programs_per_sm": 2}'
    bash benchmarks/fp8_mlp_chain.sh   # persistent_mlp_gpu.py, then this with its best tiling and --lm-head

``--fuse-act-quant`` times fp8 a second time with ``quant_tiles.FUSE_FP8_ACT_QUANT`` on (the norms and
silu_and_mul emit the e4m3 activations of qkv / gate_up / down themselves: 3 launches fewer per layer, the same
bits; ``models/llama.py``), as method ``fp8_fused``, and first checks on this GPU that the fused ops' e4m3 rows
and scales equal the unfused op followed by the fused quantizer, bit for bit (``fused_bitwise``).
``--lm-head`` times each fused fp8 method once more with the LM head quantized too (``..._lm_head``; gpu_engine's
``fp8_lm_head``, not the bar's FP8, which keeps the bf16 LM head).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from specserve.layers import quant_tiles  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402


def fused_bitwise(config, device: torch.device, dtype: torch.dtype) -> dict:
    """On this GPU: each fused FP8 op's (e4m3 row, scale) == (the unfused op, then the fused quantizer), bit for
    bit, and its 16-bit output / residual unchanged, at the model's widths and a few row counts."""
    from specserve.layers.triton_ops import TritonOps
    from specserve.layers.triton_w8a16 import quantize_fp8_rows_triton
    ops, gen = TritonOps(), torch.Generator(device=device).manual_seed(0)
    hidden, inter = config.hidden_size, config.intermediate_size
    result = {}
    for rows in (1, 7, 33):
        x = (torch.randn(rows, hidden, generator=gen, device=device) * 3).to(dtype)
        res = (torch.randn(rows, hidden, generator=gen, device=device) * 5).to(dtype)
        w = torch.randn(hidden, generator=gen, device=device).to(dtype)
        gate_up = (torch.randn(rows, 2 * inter, generator=gen, device=device) * 3).to(dtype)
        res_fused = res.clone()
        cases = {
            "rms_norm": (ops.rms_norm(x, w, 1e-5), ops.rms_norm_fp8(x, w, 1e-5, write_out=True)),
            "fused_add_rms_norm": (ops.fused_add_rms_norm(x, res, w, 1e-5),
                                   ops.fused_add_rms_norm_fp8(x, res_fused, w, 1e-5, write_out=True)),
            "silu_and_mul": (ops.silu_and_mul(gate_up), ops.silu_and_mul_fp8(gate_up, write_out=True)),
        }
        for name, (out, acts) in cases.items():
            x_q, scale = quantize_fp8_rows_triton(out)
            ok = (torch.equal(acts.x, out) and torch.equal(acts.scale, scale)
                  and torch.equal(acts.x_q.view(torch.uint8), x_q.view(torch.uint8)))
            if name == "fused_add_rms_norm":
                ok = ok and torch.equal(res, res_fused)
            result[f"{name}_m{rows}"] = ok
    return result


def mlp_check(model, device: torch.device, dtype: torch.dtype) -> dict:
    """Layer 0's MLP block at one row: the persistent launch (``MLP.fused_one_row``) against the engine's ops
    (fused add + norm + quantizer, gate|up, silu_and_mul + quantizer, down) on the same inputs."""
    layer = model.layers[0]
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = layer.mlp.down_proj.weight.shape[0]
    x = torch.randn(1, hidden, device=device, generator=gen).to(dtype)
    res = (3 * torch.randn(1, hidden, device=device, generator=gen)).to(dtype)
    fused = layer.mlp.fused_one_row(x, res, layer.post_attention_layernorm)
    if fused is None:
        return {"fused": False}
    from specserve.layers.triton_ops import TritonOps
    res2 = res.clone()
    ln2 = layer.post_attention_layernorm
    ref = layer.mlp(TritonOps().fused_add_rms_norm_fp8(x, res2, ln2.weight, ln2.eps))
    out = fused[0].float()
    return {"fused": True, "residual_equal": bool(torch.equal(fused[1], res2)),
            "max_abs_diff": (out - ref.float()).abs().max().item(), "ref_max_abs": ref.float().abs().max().item(),
            "rel_l2": ((out - ref.float()).norm() / ref.float().norm()).item()}


def time_method(method: str, config, device: torch.device, dtype: torch.dtype, fused_mlp: dict | None = None) -> dict:
    """Median decode step (and graph replay) at batch 1 for ``method``: bf16, or fp8 weights with the activation
    quantizer launched alone ("fp8") or fused into the norms and silu_and_mul ("fp8_fused*")."""
    t0 = time.perf_counter()
    quant_tiles.FUSE_FP8_ACT_QUANT = method.startswith("fp8_fused")  # read at every layer call (models/llama.py)
    with_mlp = method.removesuffix("_lm_head") == "fp8_fused_mlp"
    quant_tiles.FUSED_MLP_ONE_ROW = fused_mlp if with_mlp else None
    model = ge.dummy_model(config, 1024, dtype, device)
    if method != "bf16":
        ge.quantize_model(model, "fp8", lm_head=method.endswith("_lm_head"))
        ge.free(device)
    check = mlp_check(model, device, dtype) if with_mlp else None
    engine = ge.engine_for(model, config, device, 1, 4.0, 1024, 8192, proposers={})
    r = ge.time_decode_steps(engine, device, 1, 512, 20)
    result = {k: r[k] for k in ("median_step_s", "graph_replay_s")}
    result["fuse_fp8_act_quant"] = quant_tiles.FUSE_FP8_ACT_QUANT
    if check is not None:
        result["fused_mlp"], result["mlp_check"] = fused_mlp, check
        print("mlp_check", check, flush=True)
    quant_tiles.FUSED_MLP_ONE_ROW = None
    print(method, r["median_step_s"], r["graph_replay_s"], f"{time.perf_counter() - t0:.1f} s", flush=True)
    del engine, model
    ge.free(device)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fuse-act-quant", action="store_true",
                    help="also time fp8 with quant_tiles.FUSE_FP8_ACT_QUANT on (method fp8_fused)")
    ap.add_argument("--gemv-m1", action="store_true",
                    help="also time fp8 (fused) with the CUDA-core GEMV tiles for one row that W8A16_TILES had "
                         "before the fp8 MMA (method fp8_fused_gemv_m1)")
    ap.add_argument("--lm-head", action="store_true",
                    help="also time each fused fp8 method with the LM head quantized (methods ..._lm_head)")
    ap.add_argument("--fused-mlp", default=None,
                    help="a JSON quant_tiles.FUSED_MLP_ONE_ROW: also time fp8 (fused quantizer) with each layer's MLP "
                         "block as one persistent launch (method fp8_fused_mlp)")
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    config = shape_config("llama-3.1-8b")
    out_path = Path(os.environ.get("OUT", "benchmarks/results")) / "fp8_b1.json"
    out: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
                 "by_method": {}}
    methods = ["bf16", "fp8"]
    if args.fuse_act_quant:
        out["fused_bitwise"] = fused_bitwise(config, device, dtype)
        print("fused_bitwise", out["fused_bitwise"], flush=True)
        methods.append("fp8_fused")
    if args.gemv_m1:
        methods.append("fp8_fused_gemv_m1")
    fused_mlp = json.loads(args.fused_mlp) if args.fused_mlp else None
    if fused_mlp:
        methods.append("fp8_fused_mlp")
    if args.lm_head:
        methods += [f"{m}_lm_head" for m in methods if m in ("fp8_fused", "fp8_fused_mlp")]
    gemv_m1 = {**quant_tiles.W8A16_TILES.by_rows,
               1: quant_tiles.TileConfig(block_n=8, block_k=1024, num_warps=4, num_stages=1, use_dot=False)}
    for method in methods:
        # the tiles hold until this method's engine is gone: its CUDA graphs capture the launches
        with quant_tiles.override(quant_tiles.W8A16_TILES, gemv_m1 if method == "fp8_fused_gemv_m1" else None):
            out["by_method"][method] = time_method(method, config, device, dtype, fused_mlp)
    quant_tiles.FUSE_FP8_ACT_QUANT = False
    steps = out["by_method"]
    out["speedup_vs_bf16"] = {m: steps["bf16"]["median_step_s"] / r["median_step_s"] for m, r in steps.items()}
    print("speedup_vs_bf16", out["speedup_vs_bf16"])
    out["fp8_speedup_b1"] = steps["bf16"]["median_step_s"] / steps["fp8"]["median_step_s"]
    print("fp8_speedup_b1", out["fp8_speedup_b1"])
    if "fp8_fused" in steps:
        out["fp8_fused_speedup_b1"] = steps["bf16"]["median_step_s"] / steps["fp8_fused"]["median_step_s"]
        out["fused_vs_unfused_step"] = steps["fp8"]["median_step_s"] / steps["fp8_fused"]["median_step_s"]
        print("fp8_fused_speedup_b1", out["fp8_fused_speedup_b1"], "fused_vs_unfused_step",
              out["fused_vs_unfused_step"])
    if "fp8_fused_gemv_m1" in steps:
        gemv = steps["fp8_fused_gemv_m1"]["median_step_s"]
        out["fp8_fused_gemv_m1_speedup_b1"] = steps["bf16"]["median_step_s"] / gemv
        print("fp8_fused_gemv_m1_speedup_b1", out["fp8_fused_gemv_m1_speedup_b1"])
    if "fp8_fused_mlp" in steps:
        out["fp8_fused_mlp_speedup_b1"] = steps["bf16"]["median_step_s"] / steps["fp8_fused_mlp"]["median_step_s"]
        print("fp8_fused_mlp_speedup_b1", out["fp8_fused_mlp_speedup_b1"])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
