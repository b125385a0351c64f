#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 2 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. A batch-1 graph step takes 0.3 ms longer than a replay of its graph back to back with the
#      last, and launching steps ahead of the host did not shorten it. The GPU's own clock over
#      plain steps (scripts/profile_decode.py --timeline): the replay, the argmax and the time
#      from the argmax to the next replay.
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"
for model in llama-3.1-8b deepseek-v2-lite; do
  for batch in 1 32; do
    echo "== $model batch $batch, 1K" | tee -a "$log"
    timeout 100 python3 scripts/profile_decode.py --model $model --batch $batch --context 1024 --timeline 2>&1 \
      | grep -E "GPU clock|timeline|Error|error" | tee -a "$log"
  done
done
