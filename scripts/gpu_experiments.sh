#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 7 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. Where a batch-1 DeepSeek-V2-Lite graph step goes now, by kernel (scripts/trace_gaps.py
#      --kernels): the expert GEMVs, the latent attention at 1K (its stage 1 and merge were 8.9 +
#      3.2 us per layer, latency), the per-head latent GEMVs.
#   2. DeepSeek-V2-Lite batch 1 alternating the shortest latent partition
#      (SEGKV_CUDA_MIN_LATENT_PARTITION_ROWS 32, the default, / 64 / 128): fewer, longer pieces mean
#      fewer partials for the merge.
#   3. The engine's GPU tests at the defaults (the per-head latent GEMVs in the engine and graphs).
# (The headline table at batches 8 and 32 is unchanged by these one-row paths: gpu_check.sh with
# SEGKV_GPU_E2E remakes it.) Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! python3 -c 'import pytest' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
log="$OUT/experiments.txt"
: > "$log"
echo "== GPU tests at the defaults: engine, graphs, latent products" | tee -a "$log"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_head_gemv.py tests/test_cuda_graphs.py \
  tests/test_gpu_engine.py 2>&1 | grep -E "passed|failed|^E  " | tail -8 | tee -a "$log"
echo "== where a batch-1 graph step goes: deepseek-v2-lite, 1K, by kernel" | tee -a "$log"
timeout 120 python3 scripts/profile_decode.py --model deepseek-v2-lite --batch 1 --context 1024 --rows 5 \
  --trace /tmp/deepseek_b1.json > /dev/null 2>&1
python3 scripts/trace_gaps.py /tmp/deepseek_b1.json --kernels --min-us 5 --rows 25 2>&1 | tee -a "$log"
e2e() {  # label, env assignments..., --, decode_e2e arguments...
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "-- $label" | tee -a "$log"
  env "${envs[@]}" timeout 100 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 --batches 1 --contexts 1K,16K "$@" \
    2>&1 | grep -E "^\[|rror" | tee -a "$log"
}
echo "== DeepSeek-V2-Lite batch 1: shortest latent partition 32 / 64 / 128 rows" | tee -a "$log"
for round in 1 2; do
  for rows in 32 64 128; do
    e2e "deepseek latent partitions of at least $rows rows" SEGKV_CUDA_MIN_LATENT_PARTITION_ROWS=$rows \
      -- --models deepseek-v2-lite
  done
done
