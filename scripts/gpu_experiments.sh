#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 6 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. Where a batch-1 step of Llama-3.1-8B and Qwen3-8B goes now that a layer is five kernels
#      (q/k/v with norm and RoPE, attention, o, gate/up with norm, down with SiLU-and-mul): the
#      profiler's kernel table of an eager step and the GPU-clock split of graph steps.
#   2. The headline table: the three models at batches 1, 8, 32 and 1K / 16K context.
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"
for model in llama-3.1-8b qwen3-8b; do
  echo "== where a batch-1 step goes: $model" | tee -a "$log"
  timeout 150 python3 scripts/profile_decode.py --model "$model" --batch 1 --context 1024 --rows 20 2>&1 | tee -a "$log"
  timeout 90 python3 scripts/profile_decode.py --model "$model" --batch 1 --context 1024 --timeline 2>&1 | tee -a "$log"
done
echo "== headline table" | tee -a "$log"
timeout 300 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 --models llama-3.1-8b,qwen3-8b,deepseek-v2-lite \
  --batches 1,8,32 --contexts 1K,16K 2>&1 | grep -E "^\[|rror" | tee -a "$log"
