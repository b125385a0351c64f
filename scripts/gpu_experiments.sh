#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 8 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests of the fused split-K GEMVs (norm and SiLU-and-mul inside), the fused models,
#      graphs and engine with SEGKV_BATCH1_FUSED_GEMV=1.
#   2. The chain of a Llama-3.1-8B layer's products: separate kernels and cuBLAS against the
#      fused GEMVs (scripts/dense_gemv_sweep.py --layers).
#   3. Whole-model batch-1 decode, alternating: fused GEMVs off / on / on with the input blocks
#      visited first / on without the attention kernels' early trigger.
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
SEGKV_BATCH1_FUSED_GEMV=1 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_dense_gemv.py tests/test_fused_ops.py \
  tests/test_cuda_graphs.py tests/test_gpu_engine.py 2>&1 | grep -E "passed|failed|Error|error" | tail -8 | tee -a "$log"
echo "== layer chain" | tee -a "$log"
timeout 150 python3 scripts/dense_gemv_sweep.py --layers 2>&1 | tee -a "$log"
e2e() {  # label, env assignments...
  local label=$1; shift
  echo "-- $label" | tee -a "$log"
  env "$@" timeout 120 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 --models llama-3.1-8b \
    --batches 1 --contexts 1K,16K 2>&1 | grep -E "^\[|rror" | tee -a "$log"
}
echo "== Llama-3.1-8B batch 1" | tee -a "$log"
e2e "fused GEMVs off" SEGKV_BATCH1_FUSED_GEMV=0
e2e "fused GEMVs on" SEGKV_BATCH1_FUSED_GEMV=1
e2e "fused GEMVs on, k fastest" SEGKV_BATCH1_FUSED_GEMV=1 SEGKV_GEMV_K_FASTEST=1
e2e "fused GEMVs on, no attention trigger" SEGKV_BATCH1_FUSED_GEMV=1 SEGKV_ATTENTION_TRIGGER_NEXT=0
e2e "fused GEMVs off" SEGKV_BATCH1_FUSED_GEMV=0
e2e "fused GEMVs on" SEGKV_BATCH1_FUSED_GEMV=1
