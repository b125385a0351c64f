#!/usr/bin/env bash
# Open questions, measured on the GPU machine; results under $OUT/experiments.txt. Defaults change
# only after a measurement. Each part takes 1-3 minutes; several parts run in one call
# (bash scripts/gpu_experiments.sh merge expert prefetch):
#   merge     DeepSeek-V2-Lite batch 1 with the latent merge's cost per partition
#             (SEGKV_CUDA_LATENT_MERGE_ROWS 0 / 1, the default: 256 or 128 partitions at 16K),
#             alternating.
#   expert    one token's expert GEMVs at 256 inputs per step unrolled (the default: 64 / 72
#             registers, 8 / 7 programs per SM, so the 1408 gate/up programs take 1.3 waves) against
#             128 inputs looped (40 registers, 12 per SM: one wave), DeepSeek-V2-Lite batch 1.
#   prefetch  the L2 prefetch of the o weight before a batch-1 layer's attention
#             (SEGKV_BATCH1_PREFETCH_MB 0 / 16 / 32; DeepSeek-V2-Lite 0 / 8): its GPU tests,
#             Llama-3.1-8B, Qwen3-8B and DeepSeek-V2-Lite batch 1 alternating (at 16K attention
#             streams 64 MB per layer: the prefetched lines may not survive it).
# (The headline table at batches 8 and 32: gpu_check.sh with SEGKV_GPU_E2E.) Results of earlier
# runs, among them the parts this script had before (attention PDL, register caps, the shortest
# latent partition): docs/benchmarks.md.
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
log="$OUT/experiments.txt"
: > "$log"
e2e() {  # label, env assignments..., --, decode_e2e arguments...
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "-- $label" | tee -a "$log"
  env "${envs[@]}" timeout 100 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 "$@" \
    2>&1 | grep -E "^\[|rror" | tee -a "$log"
}
for part in "${@:-merge}"; do
if [ "$part" = merge ]; then
  echo "== DeepSeek-V2-Lite batch 1: latent merge cost per partition 0 / 1 rows" | tee -a "$log"
  for round in 1 2; do
    for rows in 0 1; do
      e2e "deepseek latent merge rows $rows" SEGKV_CUDA_LATENT_MERGE_ROWS=$rows \
        -- --models deepseek-v2-lite --batches 1 --contexts 1K,16K
    done
  done
elif [ "$part" = expert ]; then
  echo "== DeepSeek-V2-Lite batch 1: expert GEMVs 256 inputs unrolled / 128 looped" | tee -a "$log"
  for round in 1 2; do
    e2e "deepseek experts 256 unrolled" SEGKV_EXPERT_BLOCK_I=256 SEGKV_GEMV_UNROLL=1 \
      -- --models deepseek-v2-lite --batches 1 --contexts 1K,16K
    e2e "deepseek experts 128 looped" SEGKV_EXPERT_BLOCK_I=128 SEGKV_GEMV_UNROLL=0 \
      -- --models deepseek-v2-lite --batches 1 --contexts 1K,16K
  done
elif [ "$part" = prefetch ]; then
  echo "== GPU tests of the L2 prefetch" | tee -a "$log"
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_l2_prefetch.py 2>&1 | grep -E "passed|failed|^E  " \
    | tail -5 | tee -a "$log"
  echo "== batch 1: o weight prefetched into L2 before attention, 0 / 16 / 32 MB" | tee -a "$log"
  for round in 1 2; do
    for mb in 0 16 32; do
      e2e "llama-3.1-8b prefetch $mb MB" SEGKV_BATCH1_PREFETCH_MB=$mb -- --models llama-3.1-8b --batches 1 \
        --contexts 1K,16K
    done
  done
  for mb in 0 32; do
    e2e "qwen3-8b prefetch $mb MB" SEGKV_BATCH1_PREFETCH_MB=$mb -- --models qwen3-8b --batches 1 --contexts 1K,16K
  done
  for round in 1 2; do
    for mb in 0 8; do  # its o weight is 8 MB
      e2e "deepseek-v2-lite prefetch $mb MB" SEGKV_BATCH1_PREFETCH_MB=$mb -- --models deepseek-v2-lite --batches 1 \
        --contexts 1K,16K
    done
  done
else
  echo "unknown part $part (merge, expert or prefetch)" >&2
  exit 2
fi
done
