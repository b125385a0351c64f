#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 8 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. DeepSeek-V2-Lite batch 1: latent partitions of one 32-row tile
#      (SEGKV_CUDA_MIN_PARTITION_ROWS=32) against today's 64-row minimum, alternating.
#   2. Llama-3.1-8B batch 1 / 1K: stage 1 merging rows of up to 16 partials
#      (SEGKV_MERGE_IN_STAGE1_MAX=16, the 1K plan's 16 partitions) against 8 (the merge kernel).
#   3. Where a DeepSeek batch-1 graph step's GPU time goes (trace_gaps --kernels).
#   4. The cascade over a prefix sealed in 30 segments (decode_attention's cascade_segments30)
#      before and after consecutive shared segments became one run: make ab_old/ first with
#      `git archive 33e1688 segkv | tar -x -C ab_old && cp segkv/bench/decode_attention.py
#      ab_old/segkv/bench/` (skipped without it).
# A/B against an earlier revision in the same run: `git archive <rev> segkv | tar -x -C ab_old`
# here, then run the benchmark from inside ab_old/ (cd ab_old && PYTHONPATH=$PWD python3 -m ...).
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"
e2e() { timeout 150 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 "$@" 2>&1 | grep -E "^\[|rror" | tee -a "$log"; }
for rows in 32 64 32 64; do
  echo "== deepseek batch 1, SEGKV_CUDA_MIN_PARTITION_ROWS=$rows" | tee -a "$log"
  SEGKV_CUDA_MIN_PARTITION_ROWS=$rows e2e --models deepseek-v2-lite --batches 1 --contexts 1K,16K
done
for bound in 16 8 16 8; do
  echo "== llama batch 1, SEGKV_MERGE_IN_STAGE1_MAX=$bound" | tee -a "$log"
  SEGKV_MERGE_IN_STAGE1_MAX=$bound e2e --models llama-3.1-8b --batches 1 --contexts 1K
done
echo "== deepseek-v2-lite, batch 1, 1K" | tee -a "$log"
timeout 200 python3 scripts/profile_decode.py --model deepseek-v2-lite --rows 45 --trace "$OUT/ds.json" 2>&1 \
  | tee -a "$log" | grep -E "^graphs|replay|host plan"
python3 scripts/trace_gaps.py "$OUT/ds.json" --kernels --min-us 20 --rows 40 2>&1 | tee -a "$log"
gzip -f "$OUT/ds.json"
if [ -d ab_old ]; then
  for rev in old new; do
    echo "== cascade, $rev" | tee -a "$log"
    dir=$PWD; [ $rev = old ] && dir=$PWD/ab_old
    (cd "$dir" && PYTHONPATH=$dir timeout 120 python3 -m segkv.bench.decode_attention --cascade-only --trials 5) 2>&1 \
      | grep -E "cascade|no_sharing|rror" | tee -a "$log"
  done
fi
