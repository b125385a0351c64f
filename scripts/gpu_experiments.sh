#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 4 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests of the graph runner (indices staged behind the previous replay) and the GEMV.
#   2. Whole-model decode, DeepSeek-V2-Lite (batch 1/8/32) and Llama-3.1-8B (batch 1/8) with the
#      expert GEMV pairs-fastest again and one token's pairs unrolled.
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"
if ! python3 -c 'import pytest' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

echo "== GPU tests" | tee -a "$log"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_expert_gemv.py \
  tests/test_moe_ops.py 2>&1 | tail -3 | tee -a "$log"

echo "== end to end" | tee -a "$log"
timeout 200 python3 -m segkv.bench.decode_e2e --models deepseek-v2-lite --batches 1,8,32 --contexts 1K,16K \
  --skip-hf 2>&1 | grep -E "^\[" | tee -a "$log"
timeout 150 python3 -m segkv.bench.decode_e2e --models llama-3.1-8b --batches 1,8 --contexts 1K,16K \
  --skip-hf 2>&1 | grep -E "^\[" | tee -a "$log"
