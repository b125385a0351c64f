#!/usr/bin/env bash
# Per-head latent GEMVs (SEGKV_BATCH1_LATENT_GEMV) on the GPU machine, short: the kernel tests,
# DeepSeek-V2-Lite batch 1 off / on, the model tests, off / on again. Results: $OUT/latent.txt.
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
log="$OUT/latent.txt"
: > "$log"
t() { timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_head_gemv.py "$@" 2>&1 | grep -E "passed|failed|^E  " | tail -5 | tee -a "$log"; }
e2e() {
  echo "-- SEGKV_BATCH1_LATENT_GEMV=$1" | tee -a "$log"
  SEGKV_BATCH1_LATENT_GEMV=$1 timeout 60 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 --batches 1 \
    --contexts 1K,16K --models deepseek-v2-lite 2>&1 | grep -E "^\[|rror" | tee -a "$log"
}
t -k "each_heads or rejects"
e2e 0; e2e 1
t -k "mla_model"
e2e 0; e2e 1
