#!/usr/bin/env bash
# The GPU check: one command on the GPU machine, done within GPU_CHECK_BUDGET_S (default 540 s), a table printed
# last.
#
#   bench/gpu_check.sh               # on the GPU machine, from the source tree (python3, PYTHONPATH=.)
#   bench/gpu_check.sh --cpu-smoke   # tiny shapes on CPU: runs every step's code path without a GPU
#
# 0. warm-up (not judged): build the C++ CPU kernel and compile the Triton kernels by running the kernel test
#    files in parallel, one process each (bench/gpu_warmup.py); cold, step 1 needed ~110-160 s, mostly builds
# 1. kernel and gpu_path tests on the GPU (TRITON_INTERPRET=0), from the warm caches
# 2. greedy outputs of our engine on the GPU (bf16, CUDA graphs) against our torch reference on CPU (fp32), on
#    a random-weight SmolLM2-shaped checkpoint built here from a fixed seed; plus single-stream decode speed
# 3. the offline benchmark (bench/offline.py's workload: 256 seqs, lengths 100-1024, ignore_eos) on a
#    random-weight Qwen3-0.6B-shaped checkpoint
# 4. transformers generate (bf16) against ours on a 32-sequence slice of that workload
# Each step is bounded by its own cap and by the overall budget.
# The table also goes to $OUT/gpu_check.txt (and every step's log to $OUT/gpu_check_logs.txt) when $OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
case "${1:-}" in
  --cpu-smoke|--dry-run) SMOKE=1 ;;
  "") ;;
  *) echo "usage: $0 [--cpu-smoke]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false
WORK=${GPU_CHECK_DIR:-/tmp/llmserve_gpu_check}
RESULTS=$WORK/results
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_BUDGET_S:-540} ))

# run_step NAME CAP_SECONDS COMMAND...: its output to the terminal and NAME.log, "status seconds" to NAME.rc.
run_step() {
  local name=$1 cap=$2 left start
  shift 2
  left=$(( DEADLINE - $(date +%s) ))
  (( left < cap )) && cap=$left
  if (( cap < 5 )); then
    echo "== $name: skipped, no time left"
    echo "125 0" > "$RESULTS/$name.rc"
    return
  fi
  echo "== $name (at most ${cap}s): $*"
  start=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" 2>&1 | tee "$RESULTS/$name.log"
  echo "$? $(( $(date +%s) - start ))" > "$RESULTS/$name.rc"  # pipefail: the command's status (124: timed out)
}

CHECK="$PY bench/gpu_check.py"
if (( SMOKE )); then
  run_step warmup 120 env TRITON_INTERPRET=1 "$PY" bench/gpu_warmup.py tests/kernels/test_store_kv.py \
    tests/kernels/test_cpu_decode_attention.py
  run_step kernels 300 env TRITON_INTERPRET=1 "$PY" -m pytest tests/kernels/test_store_kv.py tests/gpu_path -q \
    -p no:cacheprovider
  run_step build_small 60 $CHECK build --shape tiny-llama --out "$WORK/tiny-llama"
  run_step equiv 120 $CHECK equiv --smoke --model "$WORK/tiny-llama" --device cpu --dtype bfloat16 \
    --out-json "$RESULTS/equiv.json"
  run_step build_bench 60 $CHECK build --shape tiny-qwen3 --out "$WORK/tiny-qwen3"
  run_step offline 120 $CHECK offline --smoke --model "$WORK/tiny-qwen3" --device cpu --dtype float32 \
    --out-json "$RESULTS/offline.json"
  run_step hf 120 $CHECK hf-slice --smoke --num-seqs 4 --model "$WORK/tiny-qwen3" --device cpu --dtype float32 \
    --out-json "$RESULTS/hf.json"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  run_step warmup 180 env TRITON_INTERPRET=0 "$PY" bench/gpu_warmup.py tests/kernels tests/gpu_path/test_cuda_only.py
  run_step kernels 240 env TRITON_INTERPRET=0 "$PY" -m pytest tests/kernels tests/gpu_path -q -p no:cacheprovider
  run_step build_small 60 $CHECK build --shape smollm2 --out "$WORK/smollm2"
  run_step equiv 120 $CHECK equiv --model "$WORK/smollm2" --out-json "$RESULTS/equiv.json"
  run_step build_bench 60 $CHECK build --shape qwen3-0.6b --dtype bfloat16 --out "$WORK/qwen3"
  run_step offline 150 $CHECK offline --model "$WORK/qwen3" --out-json "$RESULTS/offline.json"
  run_step hf 120 $CHECK hf-slice --num-seqs 32 --model "$WORK/qwen3" --out-json "$RESULTS/hf.json"
fi

$CHECK table --results "$RESULTS" > "$RESULTS/table.txt"
status=$?
if [[ -n "${OUT:-}" ]]; then
  cp "$RESULTS/table.txt" "$OUT/gpu_check.txt"
  for log in "$RESULTS"/*.log; do echo "===== $log"; cat "$log"; done > "$OUT/gpu_check_logs.txt"
fi
echo
cat "$RESULTS/table.txt"
exit $status
