#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 8 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. Run-ahead decode (each graph step launched over the last step's tokens still on the
#      device, before the host reads them) against the plain loop (--no-run-ahead), alternating
#      in one session: Llama-3.1-8B and DeepSeek-V2-Lite, batch 1 / 8 / 32, 1K and 16K.
#   2. Its tests with real CUDA graphs, and the graph and engine tests.
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
timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_run_ahead.py tests/test_cuda_graphs.py \
  tests/test_gpu_engine.py 2>&1 | tail -4 | tee -a "$log"

echo "== decode, run-ahead (ahead) against the plain loop (--no-run-ahead)" | tee -a "$log"
for model in llama-3.1-8b deepseek-v2-lite; do
  for flag in --no-run-ahead "" --no-run-ahead ""; do
    # shellcheck disable=SC2086
    timeout 110 python3 -m segkv.bench.decode_e2e --models $model --batches 1,8,32 --contexts 1K,16K --skip-hf \
      --trials 3 $flag 2>&1 | grep -E "^\[" | tee -a "$log"
  done
done
