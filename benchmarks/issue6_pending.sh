#!/usr/bin/env bash
# Issue 6's pending GPU measurements, all on an H200, in one device call (GPU machine, not CI), most wanted first,
# each capped in time and all of them within BUDGET seconds (default 570, under the machine's 600-second limit per
# call), so that one call returns something:
#   1. gpu_engine.py, the H200 figures of record (verify8_vs_decode_b32 with cuBLASLt on);
#   2.-4. (measured on an H100 in stop 47: results/*_h100.json): the FP8 batch-1 step profiled with
#      programmatic dependent launch off (by role), the split-K / unquantized-input knobs and the attention-half
#      ablations (decode splits / tiles on the Llama-3.1-8B shape are not repeated: x0.93-1.01 on the H100,
#      results/decode_tiles_ab_llama_h100.json; nor are fp8_step_knobs_gpu.py's one-row TILE_SETTINGS, x0.983-1.005
#      on the H100 in stop 48, results/fp8_step_tiles_h100.json).
# On any other card the script records the card and exits: nothing is pending there.
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
{ echo "$gpu"; git log --oneline -1 2>/dev/null; } > "$OUT/machine_tree.txt"

# step NAME CAP CMD...: run CMD with at most CAP seconds (less if the budget has less left), its output appended
# to $OUT/steps.log (one log: at most 8 files come back from a call) and the last lines to stdout; skipped when
# under 30 seconds are left.
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
  timeout "$cap" "$@" > "/tmp/$name.log" 2>&1
  echo "rc=$? after $SECONDS s" >> "/tmp/$name.log"
  { echo "== $name"; cat "/tmp/$name.log"; } >> "$OUT/steps.log"
  tail -n 12 "/tmp/$name.log"
}

if [[ $gpu == *H200* ]]; then
  step gpu_engine 200 python benchmarks/gpu_engine.py --out "$OUT/gpu_engine.json"
  step profile_fp8_b1_nopdl 100 env SPECSERVE_DISABLE_PDL=1 python benchmarks/verify_profile_gpu.py --batch 1 \
    --query-lens 1 --quantization fp8 --out "$OUT/profile_fp8_b1_nopdl.json"
  step fp8_step_knobs 150 python benchmarks/fp8_step_knobs_gpu.py \
    --settings waves2,balanced,balanced_gu1,o_none,down_none,o_down_none --out "$OUT/fp8_step_knobs_gpu.json"
  step fp8_ablate 150 env OUT="$OUT" python benchmarks/fp8_ablate_gpu.py \
    --variants no_attn,no_qkv,no_o,no_act_quant,no_silu_q,no_attn_half
fi
ls -l "$OUT"
