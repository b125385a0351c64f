#!/usr/bin/env bash
# Open questions of the kernels, measured in one go on the GPU machine (about 8 minutes);
# results under $OUT. Each experiment is a few quick benchmark runs under environment overrides
# (docs/configuration.md), so the defaults change only after a measurement.
#   1. latent (MLA) kernel launch sweep: tile rows, stages, warps, head-pairs per program
#   2. cascade with 16-pair tiles instead of 64
#   3. GQA launch order (a piece's KV heads side by side is the default), and tile sizes at page 32
#   Results of the last run: docs/benchmarks.md ("Second round" sections).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"

mla() {  # $1: label; environment set by the caller
  echo "== mla $1" | tee -a "$log"
  timeout 100 python3 -m segkv.bench.mla_decode --skip-layer --heads 16,128 --batches 1,8 --contexts 32768,131072 \
    --dtypes bfloat16 --trials 3 2>&1 | grep -E "^\[|kernel H=" | tee -a "$log"
}
mla "default (BLOCK_N 32, 16 pairs, 4 warps, 2 stages)"
SEGKV_MLA_STAGES=3 mla "stages 3"
SEGKV_MLA_BLOCK_N=64 mla "BLOCK_N 64"
SEGKV_MLA_BLOCK_N=16 SEGKV_MLA_STAGES=4 mla "BLOCK_N 16, stages 4"
SEGKV_MLA_WARPS=8 mla "8 warps"
SEGKV_MLA_BLOCK_M=32 SEGKV_MLA_WARPS=8 mla "32 pairs, 8 warps"

gqa() {  # $1: label, $2...: decode_attention arguments
  label=$1; shift
  echo "== gqa $label" | tee -a "$log"
  timeout 120 python3 -m segkv.bench.decode_attention --trials 3 "$@" 2>&1 | grep -v "^device" | tee -a "$log"
}
gqa "cascade, 64-pair tiles (default)" --batches 1 --contexts 4096 --shapes llama3-8b --page-sizes 16
SEGKV_TRITON_BLOCK_M=16 gqa "cascade, 16-pair tiles" --batches 1 --contexts 4096 --shapes llama3-8b --page-sizes 16
SEGKV_TRITON_HEADS_FASTEST=0 gqa "order: work items fastest" --no-cascade --shapes llama3-8b --page-sizes 16,32 --batches 1,4,16 \
  --contexts 32768,131072
gqa "order: heads fastest (default)" --no-cascade --shapes llama3-8b --page-sizes 16,32 \
  --batches 1,4,16 --contexts 32768,131072
SEGKV_TRITON_BLOCK_N=32 gqa "page 32 with one page per tile (BLOCK_N 32)" --no-cascade --shapes llama3-8b --page-sizes 32 \
  --batches 1,4 --contexts 32768,131072
SEGKV_TRITON_BLOCK_N=128 gqa "page 32 with four pages per tile (BLOCK_N 128)" --no-cascade --shapes llama3-8b \
  --page-sizes 32 --batches 1,4 --contexts 32768,131072
