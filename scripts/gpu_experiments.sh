#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 7 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests of the one-row GEMVs, fused models, graphs and engine at the defaults (register
#      caps for the norm launches, the MLA x launch with RoPE and the latent write).
#   2. Whole-model batch 1 at the defaults, and Llama-3.1-8B alternating the merge inside stage 1
#      for rows of up to 8 (default) / 16 partials (SEGKV_MERGE_IN_STAGE1_MAX): at 1K a batch-1
#      row has 11 partials, so 16 takes the merge launch out of each layer.
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
echo "== GPU tests at the defaults" | tee -a "$log"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_qkv_gemv.py tests/test_mla_x_gemv.py tests/test_dense_gemv.py \
  tests/test_expert_gemv.py tests/test_moe_ops.py tests/test_fused_ops.py tests/test_cuda_graphs.py tests/test_gpu_engine.py \
  2>&1 | grep -E "passed|failed|^E  " | tail -8 | tee -a "$log"
e2e() {  # label, env assignments..., --, decode_e2e arguments...
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "-- $label" | tee -a "$log"
  env "${envs[@]}" timeout 100 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 --batches 1 --contexts 1K,16K "$@" \
    2>&1 | grep -E "^\[|rror" | tee -a "$log"
}
echo "== batch 1 at the defaults; Llama-3.1-8B merge in stage 1 up to 8 / 16 partials" | tee -a "$log"
for round in 1 2; do
  e2e "llama merge in stage 1 up to 8" SEGKV_MERGE_IN_STAGE1_MAX=8 -- --models llama-3.1-8b
  e2e "llama merge in stage 1 up to 16" SEGKV_MERGE_IN_STAGE1_MAX=16 -- --models llama-3.1-8b
done
e2e "qwen3-8b defaults" SEGKV_TRITON_PDL=1 -- --models qwen3-8b
e2e "deepseek-v2-lite defaults" SEGKV_TRITON_PDL=1 -- --models deepseek-v2-lite
