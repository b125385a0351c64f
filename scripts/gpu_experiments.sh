#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 3 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests of the split-K GEMV and of the fused DeepSeek models with it on
#      (SEGKV_BATCH1_GEMV=1: the MLA layer's x and o products at batch 1).
#   2. DeepSeek-V2-Lite batch-1 decode with it off / on, alternating (1K).
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
echo "== GPU tests, SEGKV_BATCH1_GEMV=1" | tee -a "$log"
SEGKV_BATCH1_GEMV=1 timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_dense_gemv.py \
  tests/test_fused_ops.py -k "deepseek or moe or gemv or row_product" 2>&1 | tail -3 | tee -a "$log"
for on in 0 1 0 1; do
  echo "== deepseek batch 1, SEGKV_BATCH1_GEMV=$on" | tee -a "$log"
  SEGKV_BATCH1_GEMV=$on timeout 60 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 --models deepseek-v2-lite \
    --batches 1 --contexts 1K 2>&1 | grep -E "^\[|rror" | tee -a "$log"
done
