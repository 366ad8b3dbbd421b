"""The FP8 MLP block of a batch-1 decode step as one persistent launch (``layers/triton_fused_mlp.py``) against
the engine's five launches (fused add + RMSNorm + e4m3 quantizer, W8A16 gate|up, silu_and_mul + quantizer in
two launches, W8A16 down), Llama-3.1-8B shape, dummy weights, each chain of ``--layers`` blocks captured in one
CUDA graph (every block its own weights, so they stream from HBM). GPU machine, not CI.

    python benchmarks/persistent_mlp_gpu.py --out $OUT/persistent_mlp_gpu.json

Reported per block: the median graph replay over ``--layers``, the weight bytes it streams (gate|up + down,
e4m3: 176 MB) over that time, and that as a fraction of the copy bandwidth measured here. Correctness first
(before any timing, on this GPU): the persistent kernel, with its activations quantized per token to e4m3 as the
engine does (the default) and without (``persistent_no_act_quant``), against ``fused_mlp_reference`` (float64
sums), and the engine chain against the same reference (its fp8 MMA keeps fewer bits in its running sums, so
only close); and the barrier counter after every launch equals launches x programs x barriers (each program
arrived once at each).
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

from benchmarks.gpu_engine import copy_bandwidth  # noqa: E402
from specserve.layers import triton_pdl  # noqa: E402
from specserve.layers.quant_gpu import Fp8Linear, quantize_fp8_rows  # noqa: E402
from specserve.layers.triton_fused_mlp import fused_mlp_fp8, fused_mlp_reference  # noqa: E402
from specserve.layers.triton_ops import TritonOps  # noqa: E402

EPS = 1e-5
# (gate|up channels, K chunk, down rows, K chunk, warps, pipeline stages, programs per multiprocessor), also
# compiled for sm_90 by tests/unit/quant_compile_check.py; bk1 = H (4096): one K chunk spans the row, so each
# program makes the normed, quantized row once
TILINGS = [(8, 1024, 16, 1024, 8, 4, 1), (8, 1024, 16, 1024, 8, 6, 1), (4, 1024, 8, 1024, 4, 4, 2),
           (4, 1024, 8, 1024, 4, 4, 3), (8, 512, 16, 512, 4, 6, 1), (2, 4096, 16, 1024, 8, 4, 1),
           (2, 4096, 16, 1024, 8, 6, 1), (2, 4096, 8, 1024, 8, 4, 2), (2, 4096, 8, 2048, 8, 4, 2),
           (2, 4096, 8, 2048, 4, 4, 3)]


def make_layers(n: int, hidden: int, inter: int, device: torch.device, gen: torch.Generator) -> list[dict]:
    layers = []
    for _ in range(n):
        w_gu, s_gu = quantize_fp8_rows(torch.randn(2 * inter, hidden, device=device, generator=gen,
                                                   dtype=torch.bfloat16) * 0.02)
        w_d, s_d = quantize_fp8_rows(torch.randn(hidden, inter, device=device, generator=gen,
                                                 dtype=torch.bfloat16) * 0.02)
        norm = (1 + 0.1 * torch.randn(hidden, device=device, generator=gen)).to(torch.bfloat16)
        layers.append({"w_gu": w_gu, "s_gu": s_gu.reshape(-1).contiguous(), "w_d": w_d,
                       "s_d": s_d.reshape(-1).contiguous(), "norm": norm,
                       "gate_up": Fp8Linear(w_gu, s_gu), "down": Fp8Linear(w_d, s_d)})
    return layers


class EngineChain:
    """The engine's ops, as models/llama.py runs an MLP block at one row with FUSE_FP8_ACT_QUANT."""

    def __init__(self, layers: list[dict], x: torch.Tensor, res: torch.Tensor) -> None:
        self.layers, self.ops = layers, TritonOps()
        self.x0, self.res0 = x, res
        self.res = res.clone()

    def block(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        h = self.ops.fused_add_rms_norm_fp8(x, self.res, layer["norm"], EPS)
        return layer["down"](self.ops.silu_and_mul_fp8(layer["gate_up"](h)))

    def run(self) -> torch.Tensor:
        self.res.copy_(self.res0)
        x = self.x0
        for layer in self.layers:
            x = self.block(layer, x)
        return x


class FusedChain:
    """One ``fused_mlp_fp8`` launch per block; residual and output buffers ping-pong between blocks."""

    def __init__(self, layers: list[dict], x: torch.Tensor, res: torch.Tensor, num_programs: int,
                 tiles: dict, act_quant: bool = True) -> None:
        self.layers, self.x0, self.res0, self.p, self.tiles = layers, x, res, num_programs, tiles
        self.act_quant = act_quant
        dev, hidden = x.device, x.shape[1]
        inter = layers[0]["w_d"].shape[1]
        self.counter = torch.zeros(1, dtype=torch.int32, device=dev)
        self.amax = torch.zeros(2, dtype=torch.int32, device=dev)
        self.outs = [torch.empty_like(x) for _ in range(2)]
        self.resids = [torch.empty_like(res) for _ in range(2)]
        self.act = torch.empty(inter, dtype=x.dtype, device=dev)
        self.launches = 0
        assert hidden == x.shape[1]

    def run(self) -> torch.Tensor:
        x, res = self.x0, self.res0
        for i, layer in enumerate(self.layers):
            x, res = fused_mlp_fp8(x, res, layer["norm"], layer["w_gu"], layer["s_gu"], layer["w_d"], layer["s_d"],
                                   EPS, self.counter, self.p, amax=self.amax, act_quant=self.act_quant,
                                   residual_out=self.resids[i % 2],
                                   out=self.outs[i % 2], act=self.act, **self.tiles)
            self.launches += 1
        return x


def time_graph(fn, iters: int, warmup: int = 3) -> tuple[float, int]:
    """Median seconds of one replay of ``fn`` captured in a CUDA graph, and the replays run (warmup included)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2], warmup + iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "persistent_mlp_gpu.json"))
    args = ap.parse_args()
    t_start = time.perf_counter()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    sms = props.multi_processor_count
    hidden, inter = 4096, 14336  # Llama-3.1-8B
    gen = torch.Generator(device=device).manual_seed(0)
    layers = make_layers(args.layers, hidden, inter, device, gen)
    x = torch.randn(1, hidden, device=device, generator=gen).to(torch.bfloat16)
    res = (3 * torch.randn(1, hidden, device=device, generator=gen)).to(torch.bfloat16)
    weight_bytes = layers[0]["w_gu"].numel() + layers[0]["w_d"].numel()
    report = {"command": "python " + " ".join(sys.argv), "gpu": props.name, "sm_count": sms,
              "torch": torch.__version__, "layers": args.layers, "weight_bytes_per_block": weight_bytes,
              "copy_bandwidth_gb_s": copy_bandwidth(device, 1 << 30) / 1e9, "check": {}, "by_method": {}}
    bw = report["copy_bandwidth_gb_s"] * 1e9

    tile_sets = {f"bn{n1}_bk{k1}_bn{n2}_bk{k2}_w{w}_s{st}_x{x}":
                 (dict(bn1=n1, bk1=k1, bn2=n2, bk2=k2, num_warps=w, stages=st), x)
                 for n1, k1, n2, k2, w, st, x in TILINGS}
    # ---- correctness, one block, eager
    l0 = layers[0]
    args0 = (x, res, l0["norm"], l0["w_gu"], l0["s_gu"], l0["w_d"], l0["s_d"], EPS)
    ref, ref_res = fused_mlp_reference(*args0)
    ref_nq, _ = fused_mlp_reference(*args0, act_quant=False)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    amax = torch.zeros(2, dtype=torch.int32, device=device)
    out, res_out = fused_mlp_fp8(*args0, counter, sms, amax=amax)
    torch.cuda.synchronize()
    out_nq, _ = fused_mlp_fp8(*args0, counter, sms, act_quant=False)
    torch.cuda.synchronize()
    eng = EngineChain([l0], x, res).run()
    scale = ref.float().abs().max().item()
    report["check"] = {
        "fused_max_abs_diff": (out.float() - ref.float()).abs().max().item(),
        "fused_mismatches": int((out != ref).sum().item()),
        "fused_residual_equal": bool(torch.equal(res_out, ref_res)),
        "fused_no_act_quant_max_abs_diff": (out_nq.float() - ref_nq.float()).abs().max().item(),
        "fused_no_act_quant_mismatches": int((out_nq != ref_nq).sum().item()),
        "engine_max_abs_diff": (eng.float() - ref.float()).abs().max().item(),
        "ref_max_abs": scale,
        "counter_after_two_launches": int(counter.item()),
    }
    for name, (tiles, per_sm) in tile_sets.items():
        counter.zero_()
        amax.zero_()
        try:
            o, _ = fused_mlp_fp8(*args0, counter, sms * per_sm, amax=amax, **tiles)
            torch.cuda.synchronize()
            report["check"][name] = {"max_abs_diff": (o.float() - ref.float()).abs().max().item(),
                                     "mismatches": int((o != ref).sum().item()), "counter": int(counter.item())}
        except ValueError as e:  # e.g. more programs than fit resident
            report["check"][name] = {"error": str(e)}
    print("check", report["check"], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))  # kept if the timing below does not finish

    # ---- timing
    methods = {"engine_5_launches": lambda: EngineChain(layers, x, res)}
    for name, (tiles, per_sm) in tile_sets.items():
        if "error" not in report["check"][name]:
            methods["persistent_" + name] = (lambda t=tiles, n=per_sm: FusedChain(layers, x, res, sms * n, t))
    tiles, per_sm = tile_sets["bn2_bk4096_bn16_bk1024_w8_s4_x1"]
    methods["persistent_no_act_quant"] = lambda: FusedChain(layers, x, res, sms * per_sm, tiles, act_quant=False)
    chains = {}
    for name, make in methods.items():
        try:
            chains[name] = make()
        except Exception as e:  # noqa: BLE001
            report["by_method"][name] = {"error": repr(e)[:300]}
    for rnd in range(args.rounds):
        for name, chain in chains.items():
            for pdl in (True, False):
                # PDL off: once, for the engine and the first persistent tiling
                if not pdl and (rnd > 0 or name not in ("engine_5_launches", "persistent_" + next(iter(tile_sets)))):
                    continue
                key = name + ("" if pdl else "_no_pdl")
                triton_pdl.ENABLED = pdl
                try:
                    before = chain.launches if isinstance(chain, FusedChain) else 0
                    c0 = int(chain.counter.item()) if isinstance(chain, FusedChain) else 0
                    step, replays = time_graph(chain.run, args.iters)
                    entry = report["by_method"].setdefault(key, {"rounds_s": []})
                    entry["rounds_s"].append(step)
                    if isinstance(chain, FusedChain):
                        # launches counted at eager warm-up + capture; each replay adds `layers` launches
                        launches = (chain.launches - before - args.layers) + replays * args.layers
                        barriers = 2 if chain.act_quant else 1  # q(act) between two barriers
                        entry["counter_ok"] = int(chain.counter.item()) - c0 == launches * chain.p * barriers
                    print(key, f"{step * 1e6 / args.layers:.2f} us/block", flush=True)
                except Exception as e:  # noqa: BLE001
                    report["by_method"].setdefault(key, {})["error"] = repr(e)[:300]
                    print(key, "error", repr(e)[:300], flush=True)
                finally:
                    triton_pdl.ENABLED = True
    for entry in report["by_method"].values():
        if entry.get("rounds_s"):
            step = sorted(entry["rounds_s"])[len(entry["rounds_s"]) // 2]
            entry["us_per_block"] = step * 1e6 / args.layers
            entry["weight_tb_s"] = weight_bytes * args.layers / step / 1e12
            entry["fraction_of_copy_bw"] = weight_bytes * args.layers / step / bw
    base = report["by_method"].get("engine_5_launches", {}).get("us_per_block")
    if base:
        report["speedup_vs_engine"] = {k: base / e["us_per_block"] for k, e in report["by_method"].items()
                                       if e.get("us_per_block")}
    timed = {k: e["us_per_block"] for k, e in report["by_method"].items()
             if k.startswith("persistent_bn") and not k.endswith("_no_pdl") and e.get("us_per_block")}
    if timed:  # the fastest tiling, as quant_tiles.FUSED_MLP_ONE_ROW takes it (fp8_b1_quick.py --fused-mlp)
        tiles, per_sm = tile_sets[min(timed, key=timed.get)[len("persistent_"):]]
        report["best_one_row_config"] = {**tiles, "programs_per_sm": per_sm}
    report["total_seconds"] = time.perf_counter() - t_start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("check", "speedup_vs_engine") if k in report}, indent=1))


if __name__ == "__main__":
    main()
