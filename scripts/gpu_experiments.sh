#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 3 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. The sampler's argmax on the GPU (tests), then whole-model decode with the Triton argmax
#      against torch's (SEGKV_TRITON_ARGMAX=1 / 0, alternating; DeepSeek batch 1 / 1K measured
#      375 against 372), now for Llama and batch 32 too.
#   2. Where a batch-1 graph step's GPU time goes (DeepSeek-V2-Lite and Llama-3.1-8B, 1K): busy
#      time by kernel and the gaps between kernels inside the replays (trace_gaps --kernels).
#   3. The cascade over a prefix sealed in 30 segments (decode_attention's cascade_segments30)
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
if ! python3 -c 'import pytest' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
log="$OUT/experiments.txt"
: > "$log"
echo "== GPU tests" | tee -a "$log"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_sampling_ops.py tests/test_sampling.py 2>&1 \
  | tail -3 | tee -a "$log"
for argmax in 0 1 0 1; do
  echo "== whole-model decode, SEGKV_TRITON_ARGMAX=$argmax" | tee -a "$log"
  SEGKV_TRITON_ARGMAX=$argmax timeout 150 python3 -m segkv.bench.decode_e2e --models llama-3.1-8b,deepseek-v2-lite \
    --batches 1,32 --contexts 1K --skip-hf --trials 3 2>&1 | grep -E "^\[|rror" | tee -a "$log"
done
for model in deepseek-v2-lite llama-3.1-8b; do
  echo "== $model, batch 1, 1K" | tee -a "$log"
  timeout 200 python3 scripts/profile_decode.py --model "$model" --rows 45 --trace "$OUT/$model.json" 2>&1 \
    | tee -a "$log" | grep -E "^graphs|replay|host plan"
  python3 scripts/trace_gaps.py "$OUT/$model.json" --kernels --min-us 20 --rows 40 2>&1 | tee -a "$log"
  gzip -f "$OUT/$model.json"
done
if [ -d ab_old ]; then
  for rev in old new; do
    echo "== cascade, $rev" | tee -a "$log"
    dir=$PWD; [ $rev = old ] && dir=$PWD/ab_old
    (cd "$dir" && PYTHONPATH=$dir timeout 120 python3 -m segkv.bench.decode_attention --cascade-only --trials 5) 2>&1 \
      | grep -E "cascade|no_sharing|rror" | tee -a "$log"
  done
fi
