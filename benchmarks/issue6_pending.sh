#!/usr/bin/env bash
# Issue 6's pending GPU measurements in one device call (GPU machine, not CI), most wanted first, each capped in
# time and all of them within BUDGET seconds (default 570, under the machine's 600-second limit per call), so
# that whichever card comes, one call returns something:
#   1. on an H200 only: gpu_engine.py, the H200 figures of record (verify8_vs_decode_b32 with cuBLASLt on);
#   2. the FP8 batch-1 step profiled with programmatic dependent launch off (each kernel's own time, by role:
#      qkv / o / gate_up / down, verify_profile_gpu.py's by_role);
#   3. fp8_step_knobs_gpu.py: split-K shared out evenly (balanced, balanced_gu1) and o / down unquantized
#      (o_none, down_none, o_down_none) against the default (waves2);
#   4. fp8_ablate_gpu.py: the attention half's launches taken out (upper bounds for fusing them);
#   5. decode_tiles_ab_gpu.py on the Llama-3.1-8B shape: 2 / 4 / 8 decode splits and 64-key tiles against the
#      default (16 splits at batch 1 in a graph, whatever the context).
# Carry .whl (the nvmath-python wheel, for cuBLASLt) when the call should run gpu_engine.py as the engine runs;
# it is put on PYTHONPATH here. Logs and JSON land in $OUT.
#     bash benchmarks/issue6_pending.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
BUDGET=${BUDGET:-570}
mkdir -p "$OUT"
if compgen -G ".whl/nvmath*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/nvmath*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu" > "$OUT/machine.txt"
git log --oneline -1 > "$OUT/tree.txt" 2>/dev/null || true

# step NAME CAP CMD...: run CMD with at most CAP seconds (less if the budget has less left), its output to
# $OUT/NAME.log and the last lines to stdout; skipped when under 30 seconds are left.
step() {
  local name=$1 cap=$2 left
  shift 2
  left=$((BUDGET - SECONDS))
  if ((left < 30)); then
    echo "== $name: skipped ($left s left of $BUDGET)"
    return
  fi
  ((cap > left)) && cap=$left
  echo "== $name (at most $cap s)"
  timeout "$cap" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? after $SECONDS s" >> "$OUT/$name.log"
  tail -n 12 "$OUT/$name.log"
}

if [[ $gpu == *H200* ]]; then
  step gpu_engine 200 python benchmarks/gpu_engine.py --out "$OUT/gpu_engine.json"
fi
step profile_fp8_b1_nopdl 100 env SPECSERVE_DISABLE_PDL=1 python benchmarks/verify_profile_gpu.py --batch 1 \
  --query-lens 1 --quantization fp8 --out "$OUT/profile_fp8_b1_nopdl.json"
step fp8_step_knobs 150 python benchmarks/fp8_step_knobs_gpu.py \
  --settings waves2,balanced,balanced_gu1,o_none,down_none,o_down_none --out "$OUT/fp8_step_knobs_gpu.json"
step fp8_ablate 150 env OUT="$OUT" python benchmarks/fp8_ablate_gpu.py \
  --variants no_attn,no_qkv,no_o,no_act_quant,no_silu_q,no_attn_half
step decode_tiles_llama 120 python benchmarks/decode_tiles_ab_gpu.py --shape llama-3.1-8b --batches 1,8 \
  --contexts 512,2048 --query-lens 1 --tile-keys 32,64 --num-splits 2,4,8 --out "$OUT/decode_tiles_ab_llama.json"
ls -l "$OUT"
