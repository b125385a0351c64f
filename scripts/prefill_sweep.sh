#!/usr/bin/env bash
# Launch sweep of the stage-1 attention kernel on prefill chunks (GPU machine): one
# scripts/profile_prefill.py run per launch configuration, the chunk-time line of each.
#   usage: bash scripts/prefill_sweep.sh [history] [chunk]     (default 16384 512)
# Each configuration sets the kernel's launch through its environment overrides
# (kernels/paged_attention.py default_launch_config): BLOCK_M caps the tile's query-head rows,
# TALL_WARPS are the warps of tiles of 64+ rows, BLOCK_N the keys per step, STAGES the pipeline.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
history=${1:-16384}
chunk=${2:-512}
# SEGKV_PREFILL_CONFIGS: the "BLOCK_M TALL_WARPS BLOCK_N STAGES" launches to time, comma-separated
IFS=, read -r -a configs <<< "${SEGKV_PREFILL_CONFIGS:-64 4 64 2,64 4 64 3,128 4 64 2,128 8 64 2,128 8 64 3,128 8 128 2,64 8 128 2,128 4 32 3}"
for config in "${configs[@]}"; do
  read -r block_m warps block_n stages <<< "$config"
  printf 'BLOCK_M %3s TALL_WARPS %s BLOCK_N %3s STAGES %s: ' "$block_m" "$warps" "$block_n" "$stages"
  SEGKV_TRITON_BLOCK_M=$block_m SEGKV_TRITON_TALL_WARPS=$warps SEGKV_TRITON_BLOCK_N=$block_n \
    SEGKV_TRITON_STAGES=$stages timeout 120 python3 scripts/profile_prefill.py --history "$history" \
    --chunk "$chunk" --rows 0 2>&1 | grep -E "^chunk:|Error" || echo "failed"
done
