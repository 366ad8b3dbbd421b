"""FP8 against bf16 engine decode steps at batch 1 on the Llama-3.1-8B shape (dummy weights), alone: the
``quantized`` section of ``gpu_engine.py`` (same helpers, same definitions) for bf16 and fp8 only, when there
is not enough device time for the whole script. GPU machine, not CI.

    python benchmarks/fp8_b1_quick.py        # writes $OUT/fp8_b1.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402


def main() -> int:
    device, dtype = torch.device("cuda"), torch.bfloat16
    config = shape_config("llama-3.1-8b")
    out_path = Path(os.environ.get("OUT", "benchmarks/results")) / "fp8_b1.json"
    out: dict = {"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(device),
                 "by_method": {}}
    for method in ("bf16", "fp8"):
        t0 = time.perf_counter()
        model = ge.dummy_model(config, 1024, dtype, device)
        if method != "bf16":
            ge.quantize_model(model, method)
            ge.free(device)
        engine = ge.engine_for(model, config, device, 1, 4.0, 1024, 8192, proposers={})
        r = ge.time_decode_steps(engine, device, 1, 512, 20)
        out["by_method"][method] = {k: r[k] for k in ("median_step_s", "graph_replay_s")}
        print(method, r["median_step_s"], r["graph_replay_s"], f"{time.perf_counter() - t0:.1f} s", flush=True)
        del engine, model
        ge.free(device)
    steps = out["by_method"]
    out["fp8_speedup_b1"] = steps["bf16"]["median_step_s"] / steps["fp8"]["median_step_s"]
    print("fp8_speedup_b1", out["fp8_speedup_b1"])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
