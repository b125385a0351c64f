#!/usr/bin/env bash
# Open questions of the kernels, measured in one go on the GPU machine (about 8 minutes);
# results under $OUT/experiments.txt. Defaults change only after a measurement.
#   Partition counts around the planner's choice with the pipelined kernel (does the preference
#   for more partitions among estimates within 3% still pay?), then the full GPU grids of the
#   GQA and latent kernels and the CUDA-graph tests (every route, dtype, page size, ratio, width).
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"

echo "== partition sweeps" | tee -a "$log"
timeout 200 python3 -m segkv.bench.decode_attention --tune 16x16384,16x32768,16x131072,4x16384,4x131072,1x32768 \
  --launch 64,4,3 --trials 3 2>&1 | grep "^tune" | sed 's/p[0-9]*_head=[^ ]* //g' | tee -a "$log"
if ! python3 -c 'import pytest' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
echo "== GPU tests: full kernel grids and CUDA graphs" | tee -a "$log"
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_triton_mla.py \
  tests/test_cuda_graphs.py 2>&1 | tail -15 | tee -a "$log"
