#!/usr/bin/env bash
# FP8 weights on the GPU, results under $OUT:
#   tests   the FP8 kernel, layer, loading and engine tests (bfloat16 on CUDA, graphs)
#   linear  benchmarks.fp8_linear at 1 and 4 rows; the GEMV against the tile kernel at 1 to 16 rows
#   e2e     whole-model decode of the 8B shape, bf16 then FP8 weights (batch 1, 1K context)
#   kv      whole-model decode of the 8B shape at 16K, bf16 then FP8 KV rows (batch 16 and 32)
# Sections run in the order given (default: all three).
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(tests linear e2e)
for part in "${parts[@]}"; do
  case $part in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/layers/test_fp8.py tests/engine/test_fp8_engine.py \
        tests/models/test_fp8_loading.py 2>&1 | tail -15 | tee "$OUT/fp8_tests.txt" ;;
    linear)
      timeout 120 python3 -m benchmarks.fp8_linear --rows 1 4 --json "$OUT/fp8_linear.json" 2>&1 | tail -20 \
        | tee "$OUT/fp8_linear.txt"
      timeout 120 python3 -m benchmarks.fp8_linear --rows 1 2 3 4 8 16 --sweep gemv-or-tiles \
        --json "$OUT/fp8_gemv_or_tiles.json" 2>&1 | tail -48 | tee "$OUT/fp8_gemv_or_tiles.txt" ;;
    e2e)
      for q in none fp8; do
        timeout 200 python3 -m benchmarks.decode_e2e --models llama-3.1-8b --batches 1 --contexts 1024 --skip-hf \
          --json "$OUT/e2e_$q.json" $([ $q = fp8 ] && echo --quantization fp8) 2>&1 | tail -4 | tee -a "$OUT/e2e.txt"
      done ;;
    kv)  # an FP8 KV cache against bf16 rows at batch 16 and 32, 16K (bf16 rows of batch 32 need 64 GiB)
      for kv in auto fp8; do
        timeout 250 python3 -m benchmarks.decode_e2e --models llama-3.1-8b --batches 16,32 --contexts 16384 --skip-hf \
          --kv-cache-dtype $kv --json "$OUT/e2e_kv_$kv.json" 2>&1 | tail -4 | tee -a "$OUT/e2e_kv.txt"
      done ;;
  esac
done
