#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 7 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests of the one-launch q/k/v product with RoPE and cache write, the split-K GEMVs,
#      fused models, graphs and engine.
#   2. Whole-model batch-1 decode (Llama-3.1-8B, Qwen3-8B), alternating: RoPE and the cache
#      write in the q/k/v launch off / on (SEGKV_BATCH1_QKV_ROPE).
# Results of earlier runs: docs/benchmarks.md.
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
echo "== GPU tests" | tee -a "$log"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_qkv_gemv.py tests/test_dense_gemv.py tests/test_fused_ops.py \
  tests/test_cuda_graphs.py tests/test_gpu_engine.py 2>&1 | grep -E "passed|failed|Error|error" | tail -8 | tee -a "$log"
e2e() {  # label, env assignments..., --, decode_e2e arguments...
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "-- $label" | tee -a "$log"
  env "${envs[@]}" timeout 120 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 --batches 1 --contexts 1K,16K "$@" \
    2>&1 | grep -E "^\[|rror" | tee -a "$log"
}
echo "== batch 1: RoPE and the cache write in the q/k/v launch off / on" | tee -a "$log"
for round in 1 2; do
  e2e "llama off" SEGKV_BATCH1_QKV_ROPE=0 -- --models llama-3.1-8b
  e2e "llama on" SEGKV_BATCH1_QKV_ROPE=1 -- --models llama-3.1-8b
  e2e "qwen3 off" SEGKV_BATCH1_QKV_ROPE=0 -- --models qwen3-8b
  e2e "qwen3 on" SEGKV_BATCH1_QKV_ROPE=1 -- --models qwen3-8b
done
