#!/usr/bin/env bash
# Open questions of the kernels, measured in one go on the GPU machine (about 8 minutes);
# results under $OUT/experiments.txt. Defaults change only after a measurement.
#   1. The GQA grid (8B and 70B shapes) with the planner's cheapest-estimate rule: batch 4 / 128K
#      should take 8 partitions (0.494 ms in the sweep, against 0.517 for 33) and batch 16 two;
#      page 32 too (0.65-0.78x SDPA before the pipelined loop, unexplained).
#   2. The latent rows whose plan that rule changed (16 heads x batch 32, 128 heads x batch 2/8/32
#      at 128K), split against one pass.
#   3. Whole-model decode at batch 1/8/32 with the pipelined kernels and the one-pass merge.
# Results of earlier runs: docs/benchmarks.md ("Third round" sections).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"

echo "== gqa grid" | tee -a "$log"
timeout 240 python3 -m segkv.bench.decode_attention --trials 3 --batches 1,4,16 --contexts 16384,32768,65536,131072 \
  --shapes llama3-8b,llama3-70b --page-sizes 16,32 2>&1 | grep -E "^\[|^cascade|Error" \
  | sed 's/sdpa_efficient=[^ ]*//; s/single=[^ ]*//' | tee -a "$log"

echo "== latent rows the planner rule changed" | tee -a "$log"
timeout 150 python3 -m segkv.bench.mla_decode --skip-layer --heads 16,128 --batches 2,8,32 --contexts 131072 \
  --dtypes bfloat16 --trials 3 2>&1 | grep -E "^\[|slower|Error" | sed 's/max_rel_err=[^ ]*//' | tee -a "$log"

echo "== end to end" | tee -a "$log"
timeout 200 python3 -m segkv.bench.decode_e2e --models llama-3.1-8b,deepseek-v2-lite --batches 1,8,32 --contexts 1K,16K \
  --skip-hf 2>&1 | grep -E "^\[" | tee -a "$log"
