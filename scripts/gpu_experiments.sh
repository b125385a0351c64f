#!/usr/bin/env bash
# Open questions, measured on the GPU machine; results under $OUT/experiments.txt. Defaults change
# only after a measurement. Each part fits one call (about 8-9 minutes):
#   bash scripts/gpu_experiments.sh pdl   programmatic dependent launch for stage 1 and the merge
#        (SEGKV_ATTENTION_PDL): the GPU tests with it, whole-model batch 1 alternating off / on
#        (the q/k/v launch before attention and the o GEMV after it are PDL GEMVs now), batch 8,
#        and the kernel benchmark at batch 1 / 32K-64K (the merge launch overlapping stage 1).
#   bash scripts/gpu_experiments.sh mla   where a batch-1 DeepSeek-V2-Lite graph step goes, by
#        kernel (scripts/trace_gaps.py --kernels), the shortest latent partition
#        (SEGKV_CUDA_MIN_LATENT_PARTITION_ROWS 32, the default, / 128) alternating; and the one-row
#        GEMVs' registers (the norm launches now 64 uncapped, after 80): the Llama layer chain
#        with caps, and Llama-3.1-8B batch 1 at the defaults against this session's 222 / 198; and
#        Llama-3.1-8B batch 1 / 1K with the shortest GQA partition at 32 / 64 / 128 rows.
#   bash scripts/gpu_experiments.sh prefetch   the L2 prefetch of the o weight before a batch-1
#        layer's attention (SEGKV_BATCH1_PREFETCH_MB 0 / 16 / 32; DeepSeek-V2-Lite 0 / 8): its GPU
#        tests, Llama-3.1-8B, Qwen3-8B and DeepSeek-V2-Lite batch 1 alternating (at 16K attention
#        streams 64 MB per layer: the prefetched lines may not survive it).
# (The headline table at batches 8 and 32: gpu_check.sh with SEGKV_GPU_E2E.) Results of earlier
# runs: docs/benchmarks.md.
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
log="$OUT/experiments.txt"
: > "$log"
part=${1:-pdl}
e2e() {  # label, env assignments..., --, decode_e2e arguments...
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "-- $label" | tee -a "$log"
  env "${envs[@]}" timeout 100 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 "$@" \
    2>&1 | grep -E "^\[|rror" | tee -a "$log"
}
if [ "$part" = pdl ]; then
  echo "== GPU tests with SEGKV_ATTENTION_PDL=1" | tee -a "$log"
  SEGKV_ATTENTION_PDL=1 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
    tests/test_triton_mla.py tests/test_head_gemv.py tests/test_cuda_graphs.py tests/test_gpu_engine.py \
    -k "(bf16 and 128) or not test_kernels_match_the_reference" 2>&1 | grep -E "passed|failed|^E  " | tail -8 \
    | tee -a "$log"
  echo "== batch 1: attention PDL off / on" | tee -a "$log"
  for model in llama-3.1-8b deepseek-v2-lite qwen3-8b llama-3.1-8b; do
    for on in 0 1; do
      e2e "$model attention PDL $on" SEGKV_ATTENTION_PDL=$on -- --models $model --batches 1 --contexts 1K,16K
    done
  done
  for on in 0 1; do
    e2e "llama-3.1-8b batch 8 attention PDL $on" SEGKV_ATTENTION_PDL=$on -- --models llama-3.1-8b --batches 8 \
      --contexts 1K
  done
  echo "== decode attention kernels, batch 1: PDL off / on" | tee -a "$log"
  for on in 0 1; do
    echo "-- SEGKV_ATTENTION_PDL=$on" | tee -a "$log"
    SEGKV_ATTENTION_PDL=$on timeout 90 python3 -m segkv.bench.decode_attention --shapes llama3-8b --batches 1 \
      --contexts 32768,65536 --page-sizes 32 --no-cascade --trials 5 2>&1 | grep -E "^\[|^device|rror" \
      | head -12 | tee -a "$log"
  done
elif [ "$part" = mla ]; then
  echo "== where a batch-1 graph step goes: deepseek-v2-lite, 1K, by kernel" | tee -a "$log"
  timeout 120 python3 scripts/profile_decode.py --model deepseek-v2-lite --batch 1 --context 1024 --rows 5 \
    --trace /tmp/deepseek_b1.json > /dev/null 2>&1
  python3 scripts/trace_gaps.py /tmp/deepseek_b1.json --kernels --min-us 5 --rows 25 2>&1 | tee -a "$log"
  echo "== DeepSeek-V2-Lite batch 1: shortest latent partition 32 / 128 rows" | tee -a "$log"
  for round in 1 2; do
    for rows in 32 128; do
      e2e "deepseek latent partitions of at least $rows rows" SEGKV_CUDA_MIN_LATENT_PARTITION_ROWS=$rows \
        -- --models deepseek-v2-lite --batches 1 --contexts 1K,16K
    done
  done
  echo "== Llama-3.1-8B layer chain: register caps plain / norm" | tee -a "$log"
  timeout 200 python3 scripts/dense_gemv_sweep.py --layers 2>&1 | grep -E "layer chain|rror" | tee -a "$log"
  for round in 1 2; do
    e2e "llama-3.1-8b defaults" SEGKV_TRITON_PDL=1 -- --models llama-3.1-8b --batches 1 --contexts 1K,16K
    e2e "llama-3.1-8b norm cap 72" SEGKV_GEMV_MAXNREG_NORM=72 -- --models llama-3.1-8b --batches 1 --contexts 1K,16K
  done
  echo "== Llama-3.1-8B batch 1 / 1K: shortest partition 32 / 64 (default) / 128 rows (attention is latency here)" \
    | tee -a "$log"
  for rows in 32 64 128; do
    e2e "llama-3.1-8b partitions of at least $rows rows" SEGKV_CUDA_MIN_PARTITION_ROWS=$rows -- --models llama-3.1-8b \
      --batches 1 --contexts 1K
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
  echo "unknown part $part (pdl, mla or prefetch)" >&2
  exit 2
fi
