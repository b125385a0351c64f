#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 8 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. Register caps (ptxas maxnreg) of the one-row GEMVs: more programs per multiprocessor, so
#      more weight bytes in flight across a product boundary (the next product's programs load
#      their weight block before the PDL wait). GPU tests with the caps, the Llama layer chain
#      (scripts/dense_gemv_sweep.py --layers), and whole-model batch 1 alternating caps off / on.
#   2. Where a batch-1 Llama-3.1-8B graph step goes, by kernel (busy time and the gaps between
#      kernels, scripts/trace_gaps.py --kernels).
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
CAPS=(SEGKV_GEMV_MAXNREG=48 SEGKV_GEMV_MAXNREG_NORM=72)
echo "== GPU tests of the one-row GEMVs with register caps ${CAPS[*]}" | tee -a "$log"
env "${CAPS[@]}" timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_qkv_gemv.py tests/test_mla_x_gemv.py \
  tests/test_dense_gemv.py 2>&1 | grep -E "passed|failed|^E  " | tail -8 | tee -a "$log"
echo "== Llama-3.1-8B layer chain: register caps plain / norm" | tee -a "$log"
timeout 180 python3 scripts/dense_gemv_sweep.py --layers 2>&1 | grep -E "layer chain|rror" | tee -a "$log"
e2e() {  # label, env assignments..., --, decode_e2e arguments...
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "-- $label" | tee -a "$log"
  env "${envs[@]}" timeout 120 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 --batches 1 --contexts 1K,16K "$@" \
    2>&1 | grep -E "^\[|rror" | tee -a "$log"
}
echo "== batch 1: register caps off / on" | tee -a "$log"
for round in 1 2; do
  e2e "llama caps off" SEGKV_GEMV_MAXNREG=0 -- --models llama-3.1-8b
  e2e "llama caps ${CAPS[*]}" "${CAPS[@]}" -- --models llama-3.1-8b
done
e2e "qwen caps off" SEGKV_GEMV_MAXNREG=0 -- --models qwen3-8b
e2e "qwen caps ${CAPS[*]}" "${CAPS[@]}" -- --models qwen3-8b
e2e "deepseek caps off" SEGKV_GEMV_MAXNREG=0 -- --models deepseek-v2-lite
e2e "deepseek caps ${CAPS[*]}" "${CAPS[@]}" -- --models deepseek-v2-lite
echo "== where a batch-1 graph step goes: llama-3.1-8b, 1K, by kernel" | tee -a "$log"
timeout 120 python3 scripts/profile_decode.py --model llama-3.1-8b --batch 1 --context 1024 --rows 5 \
  --trace /tmp/llama_b1.json > /dev/null 2>&1
python3 scripts/trace_gaps.py /tmp/llama_b1.json --kernels --min-us 5 --rows 20 2>&1 | tee -a "$log"
