#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 8 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. The kernel, graph and engine tests at today's defaults (the merge inside stage 1 for decode
#      rows of at most 8 partials).
#   2. The merge inside stage 1 at batch 4 (8 partials per row: SEGKV_MERGE_IN_STAGE1_MAX=8, the
#      default, against 0, the merge kernel), alternating, both shapes, page 32: a third machine's
#      view of the -1% .. +1.5% measured against a bound of 4.
#   3. The acceptance grid of GQA decode attention at page 32 (batch 1 / 4 / 16, 16K-128K).
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
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_triton_attention.py tests/test_cuda_graphs.py \
  tests/test_gpu_engine.py -k "stage1 or pipeline or graph or fully_masked or mixed or many_partials or engine" 2>&1 \
  | tail -3 | tee -a "$log"

for i in 1 2; do
  for merge in 0 8; do
    echo "== batch 4, merge in stage 1 up to $merge partials (run $i)" | tee -a "$log"
    SEGKV_MERGE_IN_STAGE1_MAX=$merge timeout 60 python3 -m segkv.bench.decode_attention --no-cascade --trials 3 \
      --shapes llama3-8b,llama3-70b --page-sizes 32 --batches 4 --contexts 32768,131072 2>&1 | grep -E "^\[" \
      | sed -E 's/ sdpa_efficient=[^ ]+//; s/ segments[0-9]+=[^ ]+//g' | tee -a "$log"
  done
done

echo "== the acceptance grid, page 32" | tee -a "$log"
timeout 150 python3 -m segkv.bench.decode_attention --trials 3 --shapes llama3-8b,llama3-70b --page-sizes 32 \
  --batches 1,4,16 --contexts 16384,32768,65536,131072 2>&1 | grep -E "^\[|^cascade" \
  | sed -E 's/ sdpa_efficient=[^ ]+//' | tee -a "$log"
