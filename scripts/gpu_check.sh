#!/usr/bin/env bash
# GPU tests and benchmarks in one go on the GPU machine; results under $OUT.
# Uses the machine's own python3 (torch + triton); segkv runs from the working tree.
#   SEGKV_GPU_TESTS  pytest -k expression for the kernel tests ("" = the full grid, about an hour)
#   SEGKV_GPU_TUNE   partition-count sweep cases, e.g. 1x131072,4x32768 (empty: skip), run for each
#                    SEGKV_GPU_LAUNCHES entry BLOCK_N,WARPS,STAGES
#   SEGKV_GPU_BENCH  arguments for benchmarks.decode_attention ("skip" to skip)
#   SEGKV_GPU_MLA_BENCH  arguments for benchmarks.mla_decode ("skip" to skip)
#   SEGKV_GPU_E2E    arguments for benchmarks.decode_e2e, e.g. "--models llama-3.1-8b --skip-hf" (empty: skip),
#                    followed by scripts/profile_decode.py (batch 1, 1K context)
#   SEGKV_GPU_SPEC   non-empty: benchmarks.spec_decode (end to end: every method, k = 1..4, batch 1 and 8;
#                    then the verify-step cost at the 8B and DeepSeek-V2-Lite shapes)
#   SEGKV_GPU_STRUCTURED  non-empty: benchmarks.structured_output (json_schema against free, batch 1 and 32)
#   SEGKV_GPU_TRAIN  non-empty: retrain the built-in models (about 6.5 min) and compare them byte for byte
# Installs pytest from .whl/ (carried) when the machine lacks it (scripts/gpu_env.sh).
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
python3 -m pytest -q -p no:cacheprovider tests/attention/test_triton_attention.py tests/attention/test_triton_mla.py tests/runner/test_cuda_graphs.py tests/kernels/test_expert_gemv.py tests/kernels/test_expert_mlp.py tests/kernels/test_grouped_expert_gemm.py tests/kernels/test_moe_ops.py tests/kernels/test_dense_gemv.py tests/kernels/test_mla_x_gemv.py tests/kernels/test_head_gemv.py tests/kernels/test_sampling_ops.py tests/kernels/test_fused_ops.py tests/engine/test_gpu_engine.py tests/engine/test_auto_defaults.py \
  -k "${SEGKV_GPU_TESTS:-}" 2>&1 | tail -25 | tee "$OUT/tests.txt"
if [ -n "${SEGKV_GPU_TUNE:-}" ]; then  # one process per launch configuration
  for launch in ${SEGKV_GPU_LAUNCHES:-64,4,2 64,4,3 128,4,2 128,8,2 32,4,2 64,8,2}; do
    timeout 300 python3 -m benchmarks.decode_attention --tune "$SEGKV_GPU_TUNE" --launch "$launch" --trials 3 \
      --json "/tmp/tune_${launch//,/_}.json" 2>&1 | grep -v "^device" | tee -a "$OUT/tune.txt"
  done
  python3 -c 'import glob, json, sys; json.dump([json.load(open(f)) for f in sorted(glob.glob("/tmp/tune_*.json"))], open(sys.argv[1], "w"))' "$OUT/tune.json"
fi
if [ "${SEGKV_GPU_BENCH:-}" != "skip" ]; then
  # shellcheck disable=SC2086
  python3 -m benchmarks.decode_attention --json "$OUT/decode_attention.json" ${SEGKV_GPU_BENCH:-} 2>&1 \
    | tee "$OUT/bench.txt"
fi
if [ "${SEGKV_GPU_MLA_BENCH:-}" != "skip" ]; then  # the latent (MLA) kernel and layer benchmark
  # shellcheck disable=SC2086
  python3 -m benchmarks.mla_decode --json "$OUT/mla_decode.json" ${SEGKV_GPU_MLA_BENCH:-} 2>&1 | tee "$OUT/mla_bench.txt"
fi
if [ -n "${SEGKV_GPU_E2E:-}" ]; then  # whole-model decode against its bandwidth limit, then where a step goes
  # shellcheck disable=SC2086
  python3 -m benchmarks.decode_e2e --json "$OUT/decode_e2e.json" ${SEGKV_GPU_E2E} 2>&1 | tee "$OUT/e2e.txt"
  python3 scripts/profile_decode.py 2>&1 | tee "$OUT/profile.txt" | grep -E "graphs=|replay|host"
fi
if [ -n "${SEGKV_GPU_SPEC:-}" ]; then  # speculative decoding: speedups, acceptance, verify-step cost
  timeout 280 python3 -m benchmarks.spec_decode --parts e2e --cases default:ngram,default-mla:mtp,default-mla:draft_model \
    --ks 1,2,3 --temperatures 0 --json "$OUT/spec_e2e.json" 2>&1 | tail -30 | tee "$OUT/spec_e2e.txt"
  timeout 280 python3 -m benchmarks.spec_decode --parts verify --json "$OUT/spec_verify.json" 2>&1 | tail -30 \
    | tee "$OUT/spec_verify.txt"
fi
if [ -n "${SEGKV_GPU_STRUCTURED:-}" ]; then  # constrained decoding's cost per output token (carry xgrammar in .whl/)
  timeout 150 python3 -m benchmarks.structured_output --batches 1,32 --json "$OUT/structured.json" 2>&1 | tail -8 \
    | tee "$OUT/structured.txt"
fi
if [ -n "${SEGKV_GPU_TRAIN:-}" ]; then  # regenerate the built-in models and compare with the packaged ones
  python3 -m tools.default_models.train --device cuda --out-dir /tmp/segkv-default-models --no-plot 2>&1 \
    | grep -v "step .*/.* loss" | tee "$OUT/train.txt"
  for m in qwen3-gqa deepseek-mla; do
    a=$(sha256sum < "segkv/default_models/$m/model.safetensors"); b=$(sha256sum < "/tmp/segkv-default-models/$m/model.safetensors")
    [ "$a" = "$b" ] && echo "regenerate $m: identical" || echo "regenerate $m: DIFFERENT"
  done | tee -a "$OUT/train.txt"
fi
