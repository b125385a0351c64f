#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 8 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. The engine's defaults as they now are (pages of 32 rows on CUDA, the tail's page tuple
#      kept between steps): the graph, engine and kernel tests, then whole-model decode at
#      batch 1 / 8 / 32, 1K and 16K (the README's headline).
#   2. The host's turn between two graph steps at batch 32 / 16K, where the kept tail tuple
#      should show (scripts/profile_decode.py --timeline; 0.28-0.63 ms at 1K before).
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
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda_graphs.py tests/test_gpu_engine.py \
  tests/test_engine.py tests/test_triton_attention.py -k "not test_kernels_match_the_reference or split" 2>&1 \
  | tail -4 | tee -a "$log"

echo "== decode with the engine's default page size" | tee -a "$log"
for model in llama-3.1-8b deepseek-v2-lite; do
  timeout 120 python3 -m segkv.bench.decode_e2e --models $model --batches 1,8,32 --contexts 1K,16K --skip-hf \
    --trials 3 2>&1 | grep -E "^\[" | tee -a "$log"
done

for model in llama-3.1-8b deepseek-v2-lite; do
  echo "== $model batch 32, 16K: the GPU's clock per step" | tee -a "$log"
  timeout 150 python3 scripts/profile_decode.py --model $model --batch 32 --context 16384 --timeline 2>&1 \
    | grep -E "GPU clock|timeline|Error" | tee -a "$log"
done
