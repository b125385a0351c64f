#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 7 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests of the MoE decode fusions (norm + router + top-k in one launch; the combine in
#      the next norm), the fused models against the unfused, graphs against eager.
#   2. DeepSeek-V2-Lite decode with the fusions off / on (SEGKV_MOE_NORM_ROUTE,
#      SEGKV_MOE_COMBINE_IN_NORM), alternating, batch 1 and 32; then both models at the defaults.
#   3. Where a DeepSeek batch-1 graph step's GPU time goes now (trace_gaps --kernels).
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
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_moe_ops.py tests/test_fused_ops.py \
  tests/test_gpu_engine.py tests/test_cuda_graphs.py 2>&1 | tail -4 | tee -a "$log"
e2e() { timeout 150 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 "$@" 2>&1 | grep -E "^\[|rror" | tee -a "$log"; }
for pass in 1 2; do
  for mode in "0 0" "1 1"; do
    set -- $mode
    echo "== deepseek, SEGKV_MOE_NORM_ROUTE=$1 SEGKV_MOE_COMBINE_IN_NORM=$2" | tee -a "$log"
    SEGKV_MOE_NORM_ROUTE=$1 SEGKV_MOE_COMBINE_IN_NORM=$2 e2e --models deepseek-v2-lite --batches 1,32 --contexts 1K
  done
done
echo "== deepseek and llama, today's defaults" | tee -a "$log"
e2e --models deepseek-v2-lite,llama-3.1-8b --batches 1 --contexts 1K,16K
echo "== deepseek-v2-lite, batch 1, 1K" | tee -a "$log"
timeout 200 python3 scripts/profile_decode.py --model deepseek-v2-lite --rows 10 --trace "$OUT/ds.json" 2>&1 \
  | tee -a "$log" | grep -E "^graphs|replay|host plan"
python3 scripts/trace_gaps.py "$OUT/ds.json" --kernels --min-us 20 --rows 30 2>&1 | tee -a "$log"
gzip -f "$OUT/ds.json"
