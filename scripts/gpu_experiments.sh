#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 10 minutes); results under
# $OUT/experiments.txt (and $OUT/ncu.txt). Defaults change only after a measurement.
#   1. Why the cascade's 64-pair programs take about 2.8 us per 64 x 64 tile (15% of an SM's MMA
#      peak), and why the latent kernel takes about 11 us per layer at 1K context in a DeepSeek
#      decode step: Nsight Compute stall reasons (scripts/ncu_kernels.sh, all four cases).
#   2. The Llama-3-70B shape at batch 1 ran 5-8% slower with the planner's 33 partitions than the
#      8-segment plan's 32 (the 8B shape did not): the partition sweep for that shape.
#   3. What the host does in the 0.35-0.40 ms between two batch-1 graph replays (DeepSeek-V2-Lite,
#      Llama-3.1-8B): a trace of graph steps and the host events overlapping the GPU's idle gaps.

#      (SEGKV_ROUTER_LOGITS_IN_KERNEL=1) against the separate product, batch 1 and 8.
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"

echo "== 70B shape, batch 1: partitions" | tee -a "$log"
timeout 150 python3 -m segkv.bench.decode_attention --tune 1x32768,1x131072 --shapes llama3-70b --launch 64,4,3 \
  --trials 3 2>&1 | grep -E "^tune" | sed 's/p[0-9]*_head=[^ ]*//g' | tee -a "$log"

echo "== Nsight Compute" | tee -a "$log"
OUT="$OUT" bash scripts/ncu_kernels.sh > /dev/null 2>&1
cat "$OUT/ncu.txt" >> "$log"

for model in deepseek-v2-lite llama-3.1-8b; do
  echo "== $model batch 1: GPU idle gaps between graph steps" | tee -a "$log"
  timeout 200 python3 scripts/profile_decode.py --model $model --batch 1 --context 1024 \
    --trace "$OUT/trace_$model.json" > "$OUT/profile_$model.txt" 2>&1
  grep -E "ms/step|replay" "$OUT/profile_$model.txt" | head -4 | tee -a "$log"
  python3 scripts/trace_gaps.py "$OUT/trace_$model.json" --min-us 20 2>&1 | tee -a "$log"
  rm -f "$OUT/trace_$model.json"  # large; the summary above is what comes back
done

echo "== DeepSeek decode: router logits in the top-k kernel (0: separate product)" | tee -a "$log"
for fused in 0 1 0 1; do
  SEGKV_ROUTER_LOGITS_IN_KERNEL=$fused timeout 120 python3 -m segkv.bench.decode_e2e --models deepseek-v2-lite \
    --batches 1,8 --contexts 1K --skip-hf 2>&1 | grep -E "^\[" | sed "s/^/logits_in_kernel=$fused /" | tee -a "$log"
done
