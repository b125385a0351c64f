#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 3 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests of the attention kernels, graphs and engine after stage-1 programs loop over
#      the plan's work items (a graph bucket's grid sized for the device).
#   2. A/B against the previous revision (ab_old/, made by git archive): the attention floor in
#      a graph bucket's buffers, and whole-model decode (Llama-3.1-8B, DeepSeek-V2-Lite).
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
if [ "${1:-}" = tests ]; then
  echo "== GPU tests" | tee -a "$log"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_triton_mla.py \
    tests/test_cuda_graphs.py tests/test_gpu_engine.py -x 2>&1 | tail -3 | tee -a "$log"
  exit 0
fi
for rev in old new old new; do
  echo "== attention floor, $rev" | tee -a "$log"
  root=$PWD; [ $rev = old ] && root=$PWD/ab_old
  PYTHONPATH=$root timeout 100 python3 scripts/attention_floor.py --contexts 1024,16384,32768 --partitions 8,11,16,33 \
    --capacity-work bucket --trials 5 2>&1 | grep -v "^empty" | tee -a "$log"
done
for rev in old new; do
  echo "== whole-model decode, $rev" | tee -a "$log"
  dir=$PWD; [ $rev = old ] && dir=$PWD/ab_old
  (cd "$dir" && PYTHONPATH=$dir timeout 200 python3 -m segkv.bench.decode_e2e --models llama-3.1-8b,deepseek-v2-lite \
    --batches 1,32 --contexts 1K,16K --skip-hf --trials 3) 2>&1 | grep -E "^\[|rror" | tee -a "$log"
done
