#!/usr/bin/env bash
# GPU tests and benchmarks in one go on the GPU machine; results under $OUT.
# Uses the machine's own python3 (torch + triton); segkv runs from the working tree.
# SEGKV_GPU_TESTS selects tests (pytest -k); the full kernel grid takes about an hour.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py -k "${SEGKV_GPU_TESTS:-}" 2>&1 \
  | tail -25 | tee "$OUT/tests.txt"
python3 -m segkv.bench.decode_attention --json "$OUT/decode_attention.json" "$@" 2>&1 | tee "$OUT/bench.txt"
