#!/usr/bin/env bash
# Nsight Compute counters of the stage-1 attention kernels (GPU machine): DRAM throughput,
# registers, resident warps, issue rate and the stall reasons per issued instruction, for one
# split launch of each. Needs ncu (present on the device machine); clocks are left alone.
#   usage: bash scripts/ncu_kernels.sh [latent16k]  (results under $OUT/ncu.txt; latent16k: only the
#          latent stage 1 at batch 1 / 16K and pages of 32, DeepSeek-V2-Lite's decode at 16K)
# The latent cases are 16 heads, batch 1, 128K and 1K (the 2nd launch is the split kernel); the
# GQA cases are Llama-3-8B, batch 4, 32K, and the cascade's first launch (its 64-pair programs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# shellcheck source=scripts/ncu_metrics.sh
source scripts/ncu_metrics.sh  # from the repository root (cd above)
show() { grep -E "_kernel \(|grid_size|duration|dram__|registers|warps_active|issue_active|inst_exec|tensor|stalled" \
  | short_stall_names; }
if [ "${1:-all}" = latent16k ]; then
  echo "== latent stage 1: 16 heads, batch 1, 16K, pages of 32"
  timeout 200 ncu --clock-control none --kernel-name regex:_mla_stage1 --launch-skip 1 --launch-count 1 \
    --metrics "$metrics" python3 -m benchmarks.mla_decode --skip-layer --heads 16 --batches 1 \
    --contexts 16384 --dtypes bfloat16 --page-size 32 --trials 1 2>&1 | show | tee "$OUT/ncu.txt"
  exit 0
fi
{
  echo "== latent stage 1: 16 heads, batch 1, 128K"
  timeout 200 ncu --clock-control none --kernel-name regex:_mla_stage1 --launch-skip 1 --launch-count 1 \
    --metrics "$metrics" python3 -m benchmarks.mla_decode --skip-layer --heads 16 --batches 1 \
    --contexts 131072 --dtypes bfloat16 --trials 1 2>&1 | show
  echo "== GQA stage 1: llama3-8b, batch 4, 32K"
  timeout 200 ncu --clock-control none --kernel-name regex:_stage1_kernel --launch-skip 2 --launch-count 1 \
    --metrics "$metrics" python3 -m benchmarks.decode_attention --trials 1 --no-cascade --shapes llama3-8b \
    --page-sizes 16 --batches 4 --contexts 32768 2>&1 | show
  echo "== GQA stage 1: the cascade (16 forks of a 32K prefix, 64-pair prefix programs)"
  timeout 200 ncu --clock-control none --kernel-name regex:_stage1_kernel --launch-skip 0 --launch-count 1 \
    --metrics "$metrics" python3 -m benchmarks.decode_attention --trials 1 --cascade-only 2>&1 | show
  echo "== latent stage 1: 16 heads, batch 1, 1K (a DeepSeek-V2-Lite decode step's attention)"
  timeout 200 ncu --clock-control none --kernel-name regex:_mla_stage1 --launch-skip 1 --launch-count 1 \
    --metrics "$metrics" python3 -m benchmarks.mla_decode --skip-layer --heads 16 --batches 1 \
    --contexts 1024 --dtypes bfloat16 --trials 1 2>&1 | show
} | tee "$OUT/ncu.txt"
