#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 4 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. The cascade's 64-pair programs take about 2.8 us per 64 x 64 tile, one warpgroup doing
#      Q.K, softmax and P.V in turn: do taller K/V tiles (128 rows per step: half the steps, twice
#      the MMA work per wait), 8 warps or fewer stages shorten them? (SEGKV_TRITON_BLOCK_N,
#      SEGKV_TRITON_TALL_WARPS, SEGKV_TRITON_STAGES; 16 forks of a 32K prefix.)
#   2. Batch 16 (0.97-0.98x the best stock SDPA at 16K-128K): the partition sweep at 128-row
#      tiles with 4 / 8 warps and 2 / 3 stages against today's 64-row, 4-warp, 3-stage launch.
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"

echo "== cascade (16 forks x 32K prefix + 512): BLOCK_N, tall warps, stages" | tee -a "$log"
for cfg in 64,4,3 128,4,3 128,8,3 128,8,2 64,8,3 64,4,2 128,4,2; do
  IFS=, read -r n w s <<< "$cfg"
  SEGKV_TRITON_BLOCK_N=$n SEGKV_TRITON_TALL_WARPS=$w SEGKV_TRITON_STAGES=$s timeout 60 \
    python3 -m segkv.bench.decode_attention --cascade-only --trials 5 2>&1 | grep -E "^cascade|  cascade:" \
    | sed "s/^/n${n}_w${w}_s${s} /" | tee -a "$log"
done

echo "== batch 16: partition sweep per launch (BLOCK_N,WARPS,STAGES)" | tee -a "$log"
for launch in 64,4,3 128,4,3 128,8,3 128,4,2; do
  timeout 90 python3 -m segkv.bench.decode_attention --tune 16x16384,16x65536 --shapes llama3-8b --launch $launch \
    --trials 3 2>&1 | grep -E "^tune" | sed -E 's/p[0-9]+_head=[^ ]*//g' | tee -a "$log"
done
