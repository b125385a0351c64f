#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 4 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests of the MoE kernels (NaN logits in the top-k, run on the CPU only so far), the
#      split-K GEMV, the fused models and the DeepSeek parity tests.
#   2. Both models at batch 1 at the defaults (DeepSeek 16K with the split-K GEMV not yet run).
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
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_moe_ops.py tests/test_dense_gemv.py tests/test_fused_ops.py \
  tests/test_deepseek_parity.py 2>&1 | tail -3 | tee -a "$log"
echo "== both models at the defaults" | tee -a "$log"
timeout 200 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 --models deepseek-v2-lite,llama-3.1-8b \
  --batches 1 --contexts 1K,16K 2>&1 | grep -E "^\[|rror" | tee -a "$log"
