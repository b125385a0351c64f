#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 7 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. GPU tests of the MoE decode kernels (fused norm-router, expert GEMVs, combine-norm, all
#      launched with programmatic dependent launch), the fused models against the unfused,
#      graphs against eager.
#   2. DeepSeek-V2-Lite decode with PDL off / on (SEGKV_TRITON_PDL), alternating, batch 1, 8 and 32
#      at 1K; then 16K at the defaults.
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! python3 -c 'import pytest' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
log="$OUT/experiments.txt"
: > "$log"
echo "== GPU tests" | tee -a "$log"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_moe_ops.py tests/test_expert_gemv.py tests/test_fused_ops.py \
  tests/test_dense_gemv.py tests/test_gpu_engine.py tests/test_cuda_graphs.py 2>&1 | tail -4 | tee -a "$log"
e2e() { timeout 150 python3 -m segkv.bench.decode_e2e --skip-hf --trials 3 "$@" 2>&1 | grep -E "^\[|rror" | tee -a "$log"; }
for pdl in 0 1 0 1; do
  echo "== deepseek, SEGKV_TRITON_PDL=$pdl" | tee -a "$log"
  SEGKV_TRITON_PDL=$pdl e2e --models deepseek-v2-lite --batches 1,8,32 --contexts 1K
done
echo "== deepseek 16K, today's defaults" | tee -a "$log"
e2e --models deepseek-v2-lite --batches 1,8,32 --contexts 16K
