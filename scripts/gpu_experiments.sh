#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 7 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests of the fused split-K GEMVs (norm and SiLU-and-mul inside).
#   2. The chain of a Llama-3.1-8B layer's products: separate kernels and cuBLAS against the
#      fused GEMVs (scripts/dense_gemv_sweep.py --layers).
#   3. Whole-model batch-1 decode (Llama-3.1-8B, Qwen3-8B, DeepSeek-V2-Lite), alternating fused
#      GEMVs off / on; Llama with the weights evicted from L2 first.
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
echo "== GPU tests (fused GEMVs on)" | tee -a "$log"
SEGKV_BATCH1_FUSED_GEMV=1 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_dense_gemv.py 2>&1 | grep -E "passed|failed|Error|error" | tail -8 | tee -a "$log"
echo "== layer chain" | tee -a "$log"
timeout 150 python3 scripts/dense_gemv_sweep.py --layers 2>&1 | tee -a "$log"
e2e() {  # label, env assignments..., --, decode_e2e arguments...
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "-- $label" | tee -a "$log"
  env "${envs[@]}" timeout 120 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 --batches 1 --contexts 1K,16K "$@" \
    2>&1 | grep -E "^\[|rror" | tee -a "$log"
}
echo "== batch 1, fused GEMVs off / on" | tee -a "$log"
e2e "llama off" SEGKV_BATCH1_FUSED_GEMV=0 -- --models llama-3.1-8b
e2e "llama on" SEGKV_BATCH1_FUSED_GEMV=1 -- --models llama-3.1-8b
e2e "qwen3 off" SEGKV_BATCH1_FUSED_GEMV=0 -- --models qwen3-8b
e2e "qwen3 on" SEGKV_BATCH1_FUSED_GEMV=1 -- --models qwen3-8b
e2e "deepseek off" SEGKV_BATCH1_FUSED_GEMV=0 -- --models deepseek-v2-lite
e2e "deepseek on" SEGKV_BATCH1_FUSED_GEMV=1 -- --models deepseek-v2-lite
e2e "llama on, evict first" SEGKV_BATCH1_FUSED_GEMV=1 SEGKV_GEMV_EVICT_FIRST=1 -- --models llama-3.1-8b
e2e "llama off" SEGKV_BATCH1_FUSED_GEMV=0 -- --models llama-3.1-8b
e2e "llama on" SEGKV_BATCH1_FUSED_GEMV=1 -- --models llama-3.1-8b
