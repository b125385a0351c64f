#!/usr/bin/env bash
# Prefill attention on the GPU machine, results under $OUT. Stages (SEGKV_PREFILL_STAGES, comma-
# separated; default tests,kernel,chunks):
#   tests   the attention kernel tests (prefill programs, both precision modes) on the GPU
#   kernel  benchmarks.prefill_attention: a 2K chunk over 16K-128K histories and whole 8K/32K
#           prompts, each SEGKV_PREFILL_LAUNCHES launch in both modes, against SDPA's backends
#   chunks  scripts/profile_prefill.py (Qwen3-8B shape, 4 layers, 16K history): chunk wall time
#           for chunks of 512-4096 rows, exact and fast
#   mla     benchmarks.mla_decode kernel level, 128 heads at batch 1 and 32 over 32K, exact then fast
#   e2e     benchmarks.prefill_e2e: first-turn TTFT at 4K/20K/50K and 16 x 2K prompts, Qwen3-8B,
#           Llama-3.1-8B and DeepSeek-V2-Lite shapes against transformers (SEGKV_PREFILL_E2E_ARGS)
#   turns   benchmarks.turns: first-turn TTFT at 20K and 50K against transformers' sdpa
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
STAGES=",${SEGKV_PREFILL_STAGES:-tests,kernel,chunks},"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
if [[ $STAGES == *,tests,* ]]; then
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/attention/test_precision_modes.py \
    tests/attention/test_triton_attention.py tests/attention/test_sliding_window.py -k "${SEGKV_PREFILL_TESTS:-}" 2>&1 | tail -15 | tee "$OUT/tests.txt"
fi
if [[ $STAGES == *,kernel,* ]]; then
  timeout 420 python3 -m benchmarks.prefill_attention --launches "${SEGKV_PREFILL_LAUNCHES:-256x8x64,128x8x64}" \
    --histories "${SEGKV_PREFILL_HISTORIES:-16384,32768,65536,131072}" --prompts "${SEGKV_PREFILL_PROMPTS:-8192,32768}" \
    --json "$OUT/prefill_attention.json" 2>&1 | tee "$OUT/prefill_attention.txt"
fi
if [[ $STAGES == *,chunks,* ]]; then
  timeout 400 python3 scripts/profile_prefill.py --history 16384 --chunk "${SEGKV_PREFILL_CHUNKS:-512,1024,2048,4096}" \
    --precisions exact,fast --rows 0 2>&1 | tee "$OUT/chunks.txt"
fi
if [[ $STAGES == *,mla,* ]]; then
  for precision in exact fast; do
    SEGKV_ATTENTION_PRECISION=$precision timeout 200 python3 -m benchmarks.mla_decode --heads 128 --batches 1,32 \
      --contexts 32768 --dtypes bfloat16 --page-size 32 --skip-layer --trials 5 --json "$OUT/mla_$precision.json" 2>&1 \
      | tail -8 | tee -a "$OUT/mla.txt"
  done
fi
if [[ $STAGES == *,e2e,* ]]; then
  # shellcheck disable=SC2086
  timeout 580 python3 -m benchmarks.prefill_e2e --json "$OUT/prefill_e2e.json" ${SEGKV_PREFILL_E2E_ARGS:-} 2>&1 \
    | grep -v Warning | tee "$OUT/prefill_e2e.txt"
fi
if [[ $STAGES == *,turns,* ]]; then
  # shellcheck disable=SC2086
  timeout 560 python3 -m benchmarks.turns --first-turns "${SEGKV_PREFILL_TURNS:-20000,50000}" --follow-ups 1 \
    --gen-tokens 2 --runs 1 --skip-forks --json "$OUT/turns.json" ${SEGKV_PREFILL_TURNS_ARGS:-} 2>&1 \
    | tail -30 | tee "$OUT/turns.txt"
fi
