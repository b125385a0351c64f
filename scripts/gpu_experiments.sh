#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 8 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. The merge inside stage 1 (SEGKV_MERGE_IN_STAGE1=1: the last program of each decode row
#      merges it, no merge launch) against the merge kernel (0): decode attention at batch 1, 4
#      and 16 over 16K-128K, alternating 0 / 1 / 0 / 1 in one session.
#   2. Its correctness on the GPU: the decode kernel tests (every page size, GQA ratio and head
#      width for the split route), fixed plan buffers, graphs, the engine.
#   3. Llama-3.1-8B decode (batch 1 and 8, 1K) with each merge.
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

echo "== decode attention: merge in stage 1 (1) or the merge kernel (0)" | tee -a "$log"
for merge in 0 1 0 1; do
  SEGKV_MERGE_IN_STAGE1=$merge timeout 170 python3 -m segkv.bench.decode_attention --shapes llama3-8b --page-sizes 16 \
    --batches 1,4,16 --contexts 16384,32768,131072 --no-cascade --trials 5 --json "$OUT/merge$merge.json" 2>&1 \
    | grep -E "^\[" | sed "s/^/merge_in_stage1=$merge /" | tee -a "$log"
  cp "$OUT/merge$merge.json" "$OUT/merge${merge}_$(date +%s).json" 2>/dev/null
done

echo "== GPU tests" | tee -a "$log"
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_triton_attention.py \
  -k "merge_inside or fully_masked or fixed_size or cuda_graph or mixed_long or (test_kernels_match and split and bf16)" 2>&1 \
  | tail -4 | tee -a "$log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda_graphs.py tests/test_gpu_engine.py 2>&1 \
  | tail -4 | tee -a "$log"

echo "== Llama-3.1-8B decode, merge in stage 1 (1) or the merge kernel (0)" | tee -a "$log"
for merge in 0 1; do
  SEGKV_MERGE_IN_STAGE1=$merge timeout 100 python3 -m segkv.bench.decode_e2e --models llama-3.1-8b \
    --batches 1,8 --contexts 1K --skip-hf 2>&1 | grep -E "^\[" | sed "s/^/merge_in_stage1=$merge /" | tee -a "$log"
done
