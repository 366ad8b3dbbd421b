#!/usr/bin/env bash
# One device call (GPU machine, not CI): time the persistent FP8 MLP block against the engine's launches
# (persistent_mlp_gpu.py), then the whole batch-1 FP8 decode step with that script's fastest tiling switched on
# (fp8_b1_quick.py --fused-mlp), each fused FP8 method also with the LM head quantized (--lm-head).
#     bash benchmarks/fp8_mlp_chain.sh      # writes $OUT/persistent_mlp_gpu.json and $OUT/fp8_b1.json
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
python benchmarks/persistent_mlp_gpu.py --out "$OUT/persistent_mlp_gpu.json"
config=$(python -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))["best_one_row_config"]))' \
  "$OUT/persistent_mlp_gpu.json")
echo "best_one_row_config $config"
OUT=$OUT python benchmarks/fp8_b1_quick.py --fuse-act-quant --lm-head --fused-mlp "$config"
