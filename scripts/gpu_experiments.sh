#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 6 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests of the MoE launches (shared experts inside the routed GEMV launches, SiLU-and-mul
#      inside the down GEMV).
#   2. Whole-model DeepSeek-V2-Lite decode at batch 1/8/32 with those launches (before: 288 / 1138 /
#      2666 tok/s at 1K), and where a batch-1 step goes now (profile_decode.py).
#   3. The expert GEMV launch sweep again: programs are now one flat list (pair-major), not a
#      (pair, block) grid.
#   4. GQA batch 16: one partition and 4 stages (fewer launches, more bytes in flight per SM).
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

echo "== MoE tests on the GPU" | tee -a "$log"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_expert_gemv.py tests/test_moe_ops.py \
  tests/test_grouped_expert_gemm.py 2>&1 | tail -3 | tee -a "$log"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_fused_ops.py tests/test_cuda_graphs.py \
  -k "moe or expert or deepseek" 2>&1 | tail -3 | tee -a "$log"

echo "== DeepSeek end to end" | tee -a "$log"
timeout 200 python3 -m segkv.bench.decode_e2e --models deepseek-v2-lite --batches 1,8,32 --contexts 1K,16K \
  --skip-hf 2>&1 | grep -E "^\[" | tee -a "$log"
echo "== DeepSeek batch-1 profile" | tee -a "$log"
timeout 200 python3 scripts/profile_decode.py --model deepseek-v2-lite --batch 1 --context 1024 --rows 40 \
  > "$OUT/profile_deepseek.txt" 2>&1
grep -E "step|replay|host" "$OUT/profile_deepseek.txt" | head -12 | tee -a "$log"

echo "== expert GEMV sweep" | tee -a "$log"
timeout 120 python3 scripts/expert_gemv_sweep.py 2>&1 | tee -a "$log"

echo "== GQA batch 16: partitions x stages" | tee -a "$log"
for launch in 64,4,3 64,4,4; do
  timeout 150 python3 -m segkv.bench.decode_attention --tune 16x16384,16x32768,16x131072 --launch $launch \
    --trials 3 2>&1 | grep -E "^tune" | sed 's/p[0-9]*_head=[^ ]*//g' | tee -a "$log"
done
