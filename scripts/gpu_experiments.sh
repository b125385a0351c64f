#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 3 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. Head-major pages: the planner's plan over a copy of the pages laid out (page, head, row,
#      dim), one contiguous block per page and KV head, against today's (page, row, head, dim),
#      where a page's rows of one head lie 2 KB apart (8 KV heads x 128 x bf16). Stock SDPA reads
#      contiguous per-head rows and leads by 2-7% at batch 16.
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"

echo "== decode attention over head-major pages (auto_head_major) and today's layout (auto)" | tee -a "$log"
timeout 400 python3 -m segkv.bench.decode_attention --shapes llama3-8b,llama3-70b --page-sizes 16,32 \
  --batches 1,4,16 --contexts 32768,131072 --no-cascade --head-major --trials 5 --json "$OUT/head_major.json" 2>&1 \
  | grep -E "^\[" | sed -E 's/ (single|segments2|segments30|sdpa_efficient)=[^ ]*//g' | tee -a "$log"
