#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 3 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. The fixed cost of a batch-1 decode attention call: stage 1 and the merge apart, over
#      partition counts and contexts (scripts/attention_floor.py); deeper K/V prefetch (4-5
#      stages) and 128-row tiles against today's 64 rows / 3 stages.
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
echo "== attention floor, page 32, launches" | tee -a "$log"
timeout 300 python3 scripts/attention_floor.py --contexts 1024,4096,32768,65536,131072 --partitions 8,16,33,66 \
  --launches "64,4,4;64,4,5;128,4,3;128,4,4;32,4,5" 2>&1 | tee -a "$log"
echo "== page 32, merge in stage 1 up to 16 partials" | tee -a "$log"
SEGKV_MERGE_IN_STAGE1_MAX=16 timeout 300 python3 scripts/attention_floor.py --contexts 1024,4096,32768 \
  --partitions 11,16 --launches "64,4,4" 2>&1 | tee -a "$log"
