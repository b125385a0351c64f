#!/usr/bin/env bash
# The server on the GPU machine in one go, results under $OUT:
#   1. the warm-up and CUDA graph tests;
#   2. scripts/warm_burst.py --both: first-burst TTFT of a fresh server with and without warm-up
#      (random Llama-3.1-8B weights, bf16);
#   3. SEGKV_GPU_SOAK=<seconds> (optional): scripts/soak.py against the built-in model on CUDA.
#   SEGKV_GPU_WARM=skip skips 1 and 2 (a soak of ~540 s fills one call on its own).
# The server's packages (fastapi, uvicorn, httpx, ...) come from .whl/ (carried) when the machine
# lacks them, made here for the machine's Python 3.12 with:
#   pip download -d .whl --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     fastapi uvicorn httpx prometheus-client tokenizers safetensors jinja2 tqdm pytest opentelemetry-api
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
if ! python3 -c 'import fastapi, uvicorn, httpx, prometheus_client' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-serve .whl/*.whl
  export PYTHONPATH="/tmp/site-serve:$PYTHONPATH"
fi
python3 -c 'import torch, triton, fastapi, uvicorn; print("torch", torch.__version__, "triton", triton.__version__,
  "fastapi", fastapi.__version__, torch.cuda.get_device_name())' 2>&1 | tee "$OUT/env.txt"
if [ "${SEGKV_GPU_WARM:-}" != "skip" ]; then
  python3 -m pytest -q -p no:cacheprovider tests/runner/test_warmup.py tests/runner/test_cuda_graphs.py 2>&1 | tail -60 \
    | tee "$OUT/tests.txt"
  timeout 480 python3 scripts/warm_burst.py --both --out "$OUT/warm_burst.json" 2>&1 | tail -40 \
    | tee "$OUT/warm_burst.txt"
fi
if [ -n "${SEGKV_GPU_SOAK:-}" ]; then
  timeout $((SEGKV_GPU_SOAK + 50)) python3 scripts/soak.py --device cuda --duration "$SEGKV_GPU_SOAK" --concurrency 8 \
    --out "$OUT/soak.json" 2>&1 | tail -40 | tee "$OUT/soak.txt"
fi
