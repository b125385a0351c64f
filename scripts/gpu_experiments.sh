#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 5 minutes); results under
# $OUT/experiments.txt and $OUT/decode_attention.json. Defaults change only after a measurement.
#   1. The acceptance grid of GQA decode attention at page 32 (batch 1 / 4 / 16, 16K-128K, both
#      shapes, the cascade), with the planner's own plan over an 8-segment history
#      ("auto_segments8", what the engine runs) beside the forced segments route.
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"
echo "== the acceptance grid, page 32" | tee -a "$log"
timeout 330 python3 -m segkv.bench.decode_attention --trials 3 --shapes llama3-8b,llama3-70b --page-sizes 32 \
  --batches 1,4,16 --contexts 16384,32768,65536,131072 --json "$OUT/decode_attention.json" 2>&1 \
  | grep -E "^\[|^cascade|^device" | sed -E 's/ sdpa_efficient=[^ ]+//' | tee -a "$log"
