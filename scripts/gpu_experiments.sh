#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 9 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. The graph, engine and step-ahead tests on the GPU (steps launched ahead are on by default there).
#   2. Whole-model decode: the engine's loop with the next step launched before the host reads
#      the tokens, against the same loop step by step, alternating in the same trials.
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
timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_lookahead.py tests/test_cuda_graphs.py \
  tests/test_gpu_engine.py 2>&1 | tail -3 | tee -a "$log"

echo "== whole-model decode, steps ahead against step by step" | tee -a "$log"
timeout 420 python3 -m segkv.bench.decode_e2e --models llama-3.1-8b,deepseek-v2-lite --batches 1,8,32 \
  --contexts 1K,16K --skip-hf --trials 3 --json "$OUT/decode_e2e.json" 2>&1 | grep -E "^\[|rror" | tee -a "$log"
