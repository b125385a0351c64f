#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 7 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests: MoE launches, and the attention kernels with P.V accumulating into the output.
#   2. The attention kernels after that change (fewer registers; no spills in 64-pair tiles):
#      GQA batch 1/16 and the cascade, latent 16 and 128 heads.
#   3. DeepSeek-V2-Lite and Llama-3.1-8B decode (shared experts in the GEMV launches for one
#      token only; 256-input GEMV steps for gate/up).
#   4. Whether launching a step's CUDA graph delays the GPU (profile_decode.py: the replay() call
#      alone, back-to-back replays), batch 1 of both models.
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"
if ! python3 -c 'import pytest' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

echo "== GPU tests" | tee -a "$log"
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_expert_gemv.py tests/test_moe_ops.py \
  tests/test_grouped_expert_gemm.py tests/test_triton_attention.py tests/test_triton_mla.py \
  -k "not match_the_reference or (bf16 and 128) or (fp32 and 64)" 2>&1 | tail -4 | tee -a "$log"

echo "== attention kernels" | tee -a "$log"
timeout 150 python3 -m segkv.bench.decode_attention --trials 3 --batches 1,16 --contexts 32768,131072 \
  --shapes llama3-8b --page-sizes 16 2>&1 | grep -E "^\[|^cascade|Error" \
  | sed 's/sdpa_efficient=[^ ]*//; s/segments30=[^ ]*//' | tee -a "$log"
timeout 120 python3 -m segkv.bench.mla_decode --skip-layer --heads 16,128 --batches 1,8 --contexts 32768,131072 \
  --dtypes bfloat16 --trials 3 2>&1 | grep -E "^\[|slower|Error" | sed 's/max_rel_err=[^ ]*//' | tee -a "$log"

echo "== end to end" | tee -a "$log"
timeout 200 python3 -m segkv.bench.decode_e2e --models deepseek-v2-lite,llama-3.1-8b --batches 1,8 --contexts 1K,16K \
  --skip-hf 2>&1 | grep -E "^\[" | tee -a "$log"

for model in deepseek-v2-lite llama-3.1-8b; do
  echo "== $model batch-1 step" | tee -a "$log"
  timeout 200 python3 scripts/profile_decode.py --model $model --batch 1 --context 1024 --rows 40 \
    > "$OUT/profile_$model.txt" 2>&1
  grep -E "ms/step|replay|host" "$OUT/profile_$model.txt" | head -8 | tee -a "$log"
done
