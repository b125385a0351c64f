#!/usr/bin/env bash
# Open questions of the kernels, measured in one go on the GPU machine (about 6 minutes);
# results under $OUT. Each experiment is a few quick benchmark runs under environment overrides
# (docs/configuration.md), so the defaults change only after a measurement.
#   Pipelining of the stage-1 loops: with the page indices carried one block ahead, 3 pipeline
#   stages give two K/V (or latent) buffers and a wait that leaves the next tile in flight during
#   this tile's products (2 stages: one buffer, the load fully exposed). Compared: 2 stages,
#   3 stages, and the register prefetch path, for GQA decode, the cascade and latent decode.
#   The Triton IR of each variant is checked for the number of buffers and the wait depth.
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"

ir() {  # $1: cache dir; each stage-1 kernel's K/V buffers, in-loop waits, registers, spills, shared memory
  ptxas=$(python3 -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))')
  for f in $(grep -l "_stage1_kernel" -r "$1" --include=*.ttgir 2>/dev/null | head -4); do
    d=$(dirname "$f"); ptx=$(ls "$d"/*.ptx | head -1)
    regs=$("$ptxas" -v --gpu-name=sm_90a "$ptx" -o /tmp/k.o 2>&1 | grep -oE "Used [0-9]+ registers|[0-9]+ bytes spill stores" | tr '\n' ' ')
    shared=$(grep -o '"shared": [0-9]*' "$d"/*.json | head -1)
    echo "  $(grep -o 'BLOCK_M[^,]*' "$d"/*.json | head -1) $(grep -o 'memdesc<[0-9]x[0-9]*x[0-9]*xbf16' "$f" | sort -u | tr '\n' ' ')" \
      "waits: $(grep -o 'async_wait.*num = [0-9]*' "$f" | grep -o 'num = [0-9]*' | tr '\n' ' ') $regs $shared"
  done
}

gqa() {  # $1: label; environment set by the caller
  echo "== gqa $1" | tee -a "$log"
  export TRITON_CACHE_DIR=/tmp/tc_$RANDOM
  timeout 150 python3 -m segkv.bench.decode_attention --trials 3 --batches 1,4,16 --contexts 32768 \
    --shapes llama3-8b --page-sizes 16 2>&1 | grep -E "^\[|^cascade|Error" | tee -a "$log"
  ir "$TRITON_CACHE_DIR" | tee -a "$log"
}
SEGKV_TRITON_CARRY=0 gqa "indices in the block's own iteration, 2 stages (before)"
gqa "carried indices, 2 stages"
SEGKV_TRITON_STAGES=3 gqa "carried indices, 3 stages"
SEGKV_TRITON_STAGES=3 SEGKV_TRITON_MAXNREG=168 gqa "carried indices, 3 stages, at most 168 registers"
SEGKV_TRITON_STAGES=3 SEGKV_CUDA_BLOCKS_PER_SM=2 gqa "carried indices, 3 stages, planner wave 2 per SM"

mla() {  # $1: label; environment set by the caller
  echo "== mla $1" | tee -a "$log"
  export TRITON_CACHE_DIR=/tmp/tc_$RANDOM
  timeout 120 python3 -m segkv.bench.mla_decode --skip-layer --heads 16 --batches 1,8 \
    --contexts 131072 --dtypes bfloat16 --trials 3 2>&1 | grep -E "^\[|slower|Error" | tee -a "$log"
  ir "$TRITON_CACHE_DIR" | tee -a "$log"
}
SEGKV_MLA_STAGES=3 mla "3 stages"
