#!/usr/bin/env bash
# Open questions of the kernels, measured in one go on the GPU machine (about 6 minutes);
# results under $OUT. Each experiment is a few quick benchmark runs under environment overrides
# (docs/configuration.md), so the defaults change only after a measurement.
#   1. 64-pair tiles without spills: 32 keys per tile (scripts/kernel_resources.py: 242 registers,
#      no spills, against 255 with spills at 64 keys) for the cascade prefix and for prefill
#   2. the latent register cap (168) at 128 heads after the latent-wave planner change
#   3. whole-model DeepSeek-V2-Lite with the latent-wave planner
# Results of earlier runs: docs/benchmarks.md ("Second round" sections).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"

cascade() {  # $1: label; environment set by the caller
  echo "== cascade $1" | tee -a "$log"
  timeout 120 python3 -m segkv.bench.decode_attention --trials 3 --batches 1 --contexts 4096 --shapes llama3-8b \
    --page-sizes 16 2>&1 | grep -E "^cascade" | tee -a "$log"
}
cascade "64 keys per tile (default)"
SEGKV_TRITON_BLOCK_N=32 cascade "32 keys per tile"

echo "== prefill" | tee -a "$log"
SEGKV_PREFILL_CONFIGS="64 4 64 2,64 4 32 2,64 4 32 3,64 8 64 2,64 8 32 2" bash scripts/prefill_sweep.sh 2>&1 | tee -a "$log"

mla() {  # $1: label; environment set by the caller
  echo "== mla $1" | tee -a "$log"
  timeout 100 python3 -m segkv.bench.mla_decode --skip-layer --heads 128 --batches 1,2,8,32 \
    --contexts 8192,32768,131072 --dtypes bfloat16 --trials 3 2>&1 | grep -E "^\[|slower" | tee -a "$log"
}
mla "128 heads, default"
SEGKV_MLA_MAXNREG=168 mla "128 heads, register cap 168"

echo "== deepseek-v2-lite end to end" | tee -a "$log"
timeout 120 python3 -m segkv.bench.decode_e2e --models deepseek-v2-lite --batches 1,8,32 --contexts 1K,16K --skip-hf \
  2>&1 | grep -E "^\[" | tee -a "$log"
