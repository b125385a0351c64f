#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 4 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. Pages of 32 rows ran the decode attention kernels 1-10% faster than pages of 16 in every
#      case of the head-major run (batch 1 / 4 / 16, 32K-128K, both shapes). Whole-model decode
#      with each page size, alternating in one session: Llama-3.1-8B and DeepSeek-V2-Lite,
#      batch 1 / 8 / 32 at 1K and 16K.
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"
for model in llama-3.1-8b deepseek-v2-lite; do
  for page in 16 32 16 32; do
    timeout 100 python3 -m segkv.bench.decode_e2e --models $model --batches 1,8,32 --contexts 1K,16K --skip-hf \
      --trials 3 --page-size $page 2>&1 | grep -E "^\[" | sed "s/^/page=$page /" | tee -a "$log"
  done
done
