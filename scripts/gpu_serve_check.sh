#!/usr/bin/env bash
# The server on the GPU machine in one go, results under $OUT:
#   1. the warm-up and CUDA graph tests;
#   2. scripts/warm_burst.py --both: first-burst TTFT of a fresh server with and without warm-up
#      (random Llama-3.1-8B weights, bf16);
#   3. SEGKV_GPU_SOAK=<seconds> (optional): scripts/soak.py against the built-in model on CUDA.
# The server's packages (fastapi, uvicorn, httpx, ...) come from .whl/ (carried) when the machine
# lacks them: pip download them for the machine's Python (see docs/benchmarks.md).
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
if ! python3 -c 'import fastapi, uvicorn, httpx, prometheus_client' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-serve .whl/*.whl
  export PYTHONPATH="/tmp/site-serve:$PYTHONPATH"
fi
python3 -c 'import torch, triton, fastapi, uvicorn; print("torch", torch.__version__, "triton", triton.__version__,
  "fastapi", fastapi.__version__, torch.cuda.get_device_name())' 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_warmup.py tests/test_cuda_graphs.py 2>&1 | tail -15 \
  | tee "$OUT/tests.txt"
timeout 480 python3 scripts/warm_burst.py --both --out "$OUT/warm_burst.json" 2>&1 | tail -40 | tee "$OUT/warm_burst.txt"
if [ -n "${SEGKV_GPU_SOAK:-}" ]; then
  timeout $((SEGKV_GPU_SOAK + 120)) python3 scripts/soak.py --device cuda --duration "$SEGKV_GPU_SOAK" \
    --out "$OUT/soak.json" 2>&1 | tail -40 | tee "$OUT/soak.txt"
fi
