#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 3 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests of the MoE router kernel and the fused MLA path (query filled in place).
#   2. Whole-model decode of DeepSeek-V2-Lite against the previous revision (ab_old/, made by git
#      archive), alternating: the router's float32 logits in one launch, no query concatenation.
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
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_moe_ops.py tests/test_fused_ops.py \
  -k "router or mla or deepseek or moe" 2>&1 | tail -3 | tee -a "$log"
for rev in old new old new; do
  echo "== whole-model decode, $rev" | tee -a "$log"
  dir=$PWD; [ $rev = old ] && dir=$PWD/ab_old
  (cd "$dir" && PYTHONPATH=$dir timeout 120 python3 -m segkv.bench.decode_e2e --models deepseek-v2-lite \
    --batches 1,8,32 --contexts 1K,16K --skip-hf --trials 3) 2>&1 | grep -E "^\[|rror" | tee -a "$log"
done
