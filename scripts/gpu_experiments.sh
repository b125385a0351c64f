#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 6 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. Kernel, graph, engine and step-ahead tests on the GPU (eager plans now reach the device
#      through page-locked copies; steps launched ahead are on by default there).
#   2. Follow-up turns and forks with steps launched ahead (segkv only).
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
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_lookahead.py tests/test_cuda_graphs.py \
  tests/test_gpu_engine.py tests/test_triton_attention.py tests/test_triton_mla.py \
  -k "lookahead or graph or engine or stage1 or mixed or masked or many_partials or rows" 2>&1 | tail -3 | tee -a "$log"

echo "== follow-up turns and forks, segkv" | tee -a "$log"
timeout 300 python3 -m segkv.bench.turns --first-turns 20000,50000 --runs 1 --skip-hf --fork-history 50000 \
  --json "$OUT/turns.json" 2>&1 | grep -vE "^\s*$|Warning|warn" | tail -40 | tee -a "$log"
