#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 8 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests of the one-row GEMVs (q/k/v with RoPE, the MLA x product with RoPE and latent
#      write, combine-norm), the fused models, graphs and engine at the defaults; the MLA tests
#      again with SEGKV_BATCH1_MLA_ROPE=1 (never run on a GPU yet).
#   2. DeepSeek-V2-Lite batch 1, alternating SEGKV_BATCH1_MLA_ROPE=0 / 1 and SEGKV_EXPERT_PRELOAD=1
#      (the expert GEMVs' first weight block before the PDL wait; never run on a GPU yet).
#   3. Where a batch-1 Llama-3.1-8B step goes now (the profiler's kernel table).
# (The headline table at batches 8 and 32 is unchanged by these one-row paths: gpu_check.sh with
# SEGKV_GPU_E2E remakes it.)
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
echo "== GPU tests at the defaults" | tee -a "$log"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_qkv_gemv.py tests/test_mla_x_gemv.py tests/test_dense_gemv.py \
  tests/test_expert_gemv.py tests/test_moe_ops.py tests/test_fused_ops.py tests/test_cuda_graphs.py tests/test_gpu_engine.py \
  2>&1 | grep -E "passed|failed|^E  " | tail -8 | tee -a "$log"
echo "== MoE/MLA tests with SEGKV_BATCH1_MLA_ROPE=1 SEGKV_EXPERT_PRELOAD=1" | tee -a "$log"
SEGKV_BATCH1_MLA_ROPE=1 SEGKV_EXPERT_PRELOAD=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_expert_gemv.py \
  tests/test_moe_ops.py tests/test_fused_ops.py tests/test_cuda_graphs.py -k "deepseek or moe or mla or expert or shared" 2>&1 \
  | grep -E "passed|failed|^E  " | tail -8 | tee -a "$log"
e2e() {  # label, env assignments..., --, decode_e2e arguments...
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "-- $label" | tee -a "$log"
  env "${envs[@]}" timeout 120 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 --batches 1 --contexts 1K,16K "$@" \
    2>&1 | grep -E "^\[|rror" | tee -a "$log"
}
echo "== DeepSeek-V2-Lite batch 1: RoPE and the latent write in the x launch off / on" | tee -a "$log"
for round in 1 2; do
  e2e "mla rope off" SEGKV_BATCH1_MLA_ROPE=0 -- --models deepseek-v2-lite
  e2e "mla rope on" SEGKV_BATCH1_MLA_ROPE=1 -- --models deepseek-v2-lite
  e2e "expert preload on" SEGKV_EXPERT_PRELOAD=1 -- --models deepseek-v2-lite
done
echo "== where a batch-1 step goes: llama-3.1-8b" | tee -a "$log"
timeout 120 python3 scripts/profile_decode.py --model llama-3.1-8b --batch 1 --context 1024 --rows 20 2>&1 | tee -a "$log"
