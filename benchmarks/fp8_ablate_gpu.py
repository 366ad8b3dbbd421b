"""Upper bounds for fusions in the FP8 decode step at batch 1 (Llama-3.1-8B shape, dummy weights): the step with
one kind of launch taken out at a time. GPU machine, not CI.

    python benchmarks/fp8_ablate_gpu.py          # writes $OUT/fp8_ablate_gpu.json

Each ablation replaces an op by a no-op that hands back a preallocated output of the right shape (the outputs are
wrong: only the step's time means anything), so the step's time without that launch bounds what fusing it
into a neighbour could save:

- ``no_silu``: ``silu_and_mul(_fp8)`` (the fp8 one is two launches at one row, each a serial chain of
  latencies on a few multiprocessors);
- ``no_silu_q``: only the second of the two (the quantizer taking the row amax from per-block amaxes);
- ``no_act_quant``: the per-token quantizer before ``o_proj`` (the attention output's e4m3 rows and scales);
- ``no_rope``: the rotary embedding (its own launch beside the KV write);
- ``no_norm``: the residual add + RMSNorm (+ quantizer) before ``qkv`` and ``gate_up``;
- ``no_small``: all of the above;
- ``no_attn``: the attention backend's launches (rope + KV write, decode attention, the split merge);
- ``no_qkv`` / ``no_o``: the qkv / o projection of every layer (its weights not read at all);
- ``no_attn_half``: everything between the input norm and the MLP's norm (qkv, attention, the quantizer, o).

``--variants`` picks some (default all).

Times are ``gpu_engine.time_decode_steps``'s (median engine step, graph replay alone) for bf16 and fp8 (bf16 LM
head, as the bar's figure), so ``bf16 / variant`` says which fusions could reach the issue's 1.7x.

H100, the attention half (results/fp8_ablate_attn_h100.json; bf16 5.49 ms, fp8 3.58 ms a step, x1.534): ms saved
a step in fp8 / bf16, no_attn 0.298 / 0.277 (9.3 / 8.7 us a layer for 2 MB of KV at context 512), no_qkv 0.339 /
0.580, no_o 0.338 / 0.399, no_attn_half 0.962 / 1.265, no_act_quant 0.058, no_silu_q 0.006. The FP8 o_proj thus
costs 10.6 us a layer for 16.8 MB (1.6 TB/s) where bf16's costs 12.5 us for twice the bytes, and qkv 10.6 us for
25 MB; attention itself is shared by both steps, so even without it the ratio would be 5.21 / 3.28 = x1.59.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from specserve.layers import triton_attention, triton_ops, triton_w8a16  # noqa: E402
from specserve.layers.quant_gpu import Fp8Activations  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402


class Cache:
    """Preallocated outputs by (name, shape, dtype): the same tensors on every call, as a captured graph wants."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.store = device, {}

    def get(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        key = (name, tuple(shape), dtype)
        if key not in self.store:
            self.store[key] = torch.ones(shape, dtype=dtype, device=self.device) if dtype != torch.float8_e4m3fn \
                else torch.ones(shape, dtype=torch.bfloat16, device=self.device).to(dtype)
        return self.store[key]


@contextlib.contextmanager
def ablate(names: set[str], cache: Cache, model):
    """Patch ``TritonOps`` / the W8A16 quantizer / the attention backend / ``model``'s projections so the named
    launches do not happen."""
    cls, saved = triton_ops.TritonOps, {}

    def patch(owner, attr, fn):
        saved[(owner, attr)] = getattr(owner, attr)
        setattr(owner, attr, fn)

    def fp8_out(name, rows, cols, dtype):
        return Fp8Activations(cache.get(name + ".q", (rows, cols), torch.float8_e4m3fn),
                              cache.get(name + ".s", (rows, 1), torch.float32), dtype, None)

    if "silu" in names:
        patch(cls, "silu_and_mul", lambda self, gu: cache.get("silu", (gu.shape[0], gu.shape[1] // 2), gu.dtype))
        patch(cls, "silu_and_mul_fp8",
              lambda self, gu, write_out=False: fp8_out("silu", gu.shape[0], gu.shape[1] // 2, gu.dtype))
    if "silu_q" in names:  # only the split silu_and_mul_fp8's second launch (the quantizer over column blocks)
        patch(triton_ops, "_quantize_blocks_kernel", _NoLaunch())
    if "act_quant" in names:
        patch(triton_w8a16, "quantize_fp8_rows_triton",
              lambda x, max_block=8192: (cache.get("aq.q", x.shape, torch.float8_e4m3fn),
                                         cache.get("aq.s", (x.shape[0], 1), torch.float32)))
    if "rope" in names:
        patch(cls, "rope_", lambda self, qk, cos, sin: qk)
    if "norm" in names:
        patch(cls, "fused_add_rms_norm", lambda self, x, res, w, eps: cache.get("norm", x.shape, x.dtype))
        patch(cls, "fused_add_rms_norm_fp8",
              lambda self, x, res, w, eps, write_out=False: fp8_out("norm", x.shape[0], x.shape[1], x.dtype))
    if "attn" in names:
        patch(triton_attention.TritonAttentionBackend, "forward",
              lambda self, q, k, v, kc, vc, meta, rope=None: cache.get("attn", q.shape, q.dtype))
    projections = [(layer.self_attn, name) for layer in model.layers for name in ("qkv", "o") if name in names]
    for attn, name in projections:
        proj = getattr(attn, name + "_proj")
        out_features = proj.weight.shape[0]
        proj.forward = (lambda x, n=out_features, name=name: cache.get(name, (_rows(x), n), torch.bfloat16))
    try:
        yield
    finally:
        for (owner, attr), fn in saved.items():
            setattr(owner, attr, fn)
        for attn, name in projections:
            del getattr(attn, name + "_proj").forward  # the class's forward again


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _rows(x) -> int:
    """Rows of a projection input: a tensor or ``Fp8Activations`` (e4m3 rows + scales)."""
    return x.shape[0] if isinstance(x, torch.Tensor) else x.x_q.shape[0]


VARIANTS = {"base": set(), "no_silu": {"silu"}, "no_silu_q": {"silu_q"}, "no_act_quant": {"act_quant"},
            "no_rope": {"rope"}, "no_norm": {"norm"}, "no_small": {"silu", "act_quant", "rope", "norm"},
            "no_attn": {"attn"}, "no_qkv": {"qkv"}, "no_o": {"o"}, "no_attn_half": {"qkv", "attn", "act_quant", "o"}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    args = ap.parse_args()
    variants = {v: VARIANTS[v] for v in ["base"] + [v for v in args.variants.split(",") if v != "base"]}
    device, dtype = torch.device("cuda"), torch.bfloat16
    config = shape_config("llama-3.1-8b")
    out_path = Path(os.environ.get("OUT", "benchmarks/results")) / "fp8_ablate_gpu.json"
    out: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
                 "torch": torch.__version__, "by_method": {}}
    t_start = time.perf_counter()
    model = ge.dummy_model(config, 1024, dtype, device)
    cache = Cache(device)
    for method in ("bf16", "fp8"):
        if method == "fp8":
            ge.quantize_model(model, "fp8")
            ge.free(device)
        for variant, names in variants.items():
            if method == "bf16" and variant in ("no_act_quant", "no_silu_q"):
                continue  # no quantizer in bf16
            with ablate(names, cache, model):
                engine = ge.engine_for(model, config, device, 1, 4.0, 1024, 8192, proposers={})
                r = ge.time_decode_steps(engine, device, 1, 512, 20)
                del engine
                ge.free(device)
            out["by_method"].setdefault(method, {})[variant] = {k: r[k] for k in ("median_step_s", "graph_replay_s")}
            print(f"{method} {variant}: step {r['median_step_s'] * 1e3:.3f} ms, replay "
                  f"{r['graph_replay_s'] * 1e3:.3f} ms ({time.perf_counter() - t_start:.0f} s)", flush=True)
    bf16 = out["by_method"]["bf16"]["base"]["median_step_s"]
    out["bf16_over_fp8_variant"] = {v: bf16 / r["median_step_s"] for v, r in out["by_method"]["fp8"].items()}
    out["saved_ms"] = {m: {v: (rs["base"]["median_step_s"] - r["median_step_s"]) * 1e3 for v, r in rs.items()}
                       for m, rs in out["by_method"].items()}
    out["total_seconds"] = time.perf_counter() - t_start
    print(json.dumps({k: out[k] for k in ("bf16_over_fp8_variant", "saved_ms")}, indent=1))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
