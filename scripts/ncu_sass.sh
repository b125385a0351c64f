#!/usr/bin/env bash
# Nsight Compute's per-instruction (SASS) stall samples of one stage-1 launch (GPU machine): where
# a kernel's warps wait, instruction by instruction. Results under $OUT: <case>_sass.csv (the
# source page: every SASS instruction with its warp-stall samples by reason) and
# <case>_details.txt (speed of light, occupancy, warp states).
#   usage: bash scripts/ncu_sass.sh [cascade|b1_32k|b1_1k]   (default: cascade)
#   cascade: the cascade's stage 1 (16 forks of a 32K prefix, Llama-3-8B shape, pages of 16);
#   b1_32k / b1_1k: the planner's stage 1 at batch 1, 32K / 1K, pages of 32.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
case_name=${1:-cascade}
case $case_name in
  cascade) args=(--trials 1 --cascade-only); skip=0 ;;
  b1_32k) args=(--trials 1 --no-cascade --shapes llama3-8b --page-sizes 32 --batches 1 --contexts 32768); skip=2 ;;
  b1_1k) args=(--trials 1 --no-cascade --shapes llama3-8b --page-sizes 32 --batches 1 --contexts 1024); skip=2 ;;
  *) echo "unknown case $case_name"; exit 2 ;;
esac
rep="/tmp/ncu_$case_name"
timeout 300 ncu --clock-control none --kernel-name regex:_stage1_kernel --launch-skip "$skip" --launch-count 1 \
  --section SourceCounters --section WarpStateStats --section LaunchStats --section Occupancy \
  --section SpeedOfLight --section MemoryWorkloadAnalysis -f -o "$rep" \
  python3 -m benchmarks.decode_attention "${args[@]}" > "$OUT/${case_name}_run.txt" 2>&1
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/${case_name}_sass.csv" 2>&1
ncu -i "$rep.ncu-rep" --page details > "$OUT/${case_name}_details.txt" 2>&1
wc -c "$OUT/${case_name}_sass.csv" "$OUT/${case_name}_details.txt"
