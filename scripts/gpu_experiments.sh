#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 3 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. The engine, graph and step-ahead tests on the GPU (a step now takes the decode rows of the
#      step launched ahead and prefills new requests in a forward of its own).
#   2. Whole-model decode at batch 1 and 32 (1K), steps ahead against step by step.
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
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_lookahead.py tests/test_gpu_engine.py \
  tests/test_cuda_graphs.py tests/test_cli.py 2>&1 | tail -3 | tee -a "$log"
echo "== whole-model decode" | tee -a "$log"
timeout 120 python3 -m segkv.bench.decode_e2e --models llama-3.1-8b --batches 1,32 --contexts 1K --skip-hf \
  --trials 3 2>&1 | grep -E "^\[|rror" | tee -a "$log"
