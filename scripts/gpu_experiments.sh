#!/usr/bin/env bash
# Open questions of the kernels, measured in one go on the GPU machine (about 6 minutes);
# results under $OUT. Each experiment is a few quick benchmark runs under environment overrides
# (docs/configuration.md), so the defaults change only after a measurement.
#   After the pipelined stage-1 loops (page indices carried one block ahead, 3 stages, 2 programs
#   per SM): the GQA grid at the new defaults, 4 stages (three K/V buffers) at batch 16, the
#   prefill chunk at 2 and 3 stages, the latent grid, and whole-model decode.
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

gqa() {  # $1: label, $2: batches, $3: contexts, $4: shapes; environment set by the caller
  echo "== gqa $1" | tee -a "$log"
  export TRITON_CACHE_DIR=/tmp/tc_$RANDOM
  timeout 240 python3 -m segkv.bench.decode_attention --trials 3 --batches "$2" --contexts "$3" \
    --shapes "$4" --page-sizes 16 2>&1 | grep -E "^\[|^cascade|Error" \
    | sed 's/sdpa_efficient=[^ ]*//; s/single=[^ ]*//' | tee -a "$log"
  ir "$TRITON_CACHE_DIR" | tee -a "$log"
}
gqa "defaults" 1,4,16 16384,32768,65536,131072 llama3-8b,llama3-70b
SEGKV_TRITON_STAGES=4 gqa "4 stages" 4,16 32768,131072 llama3-8b

echo "== prefill" | tee -a "$log"
SEGKV_PREFILL_CONFIGS="64 4 64 3,64 4 64 2,64 4 32 3,64 4 32 4" bash scripts/prefill_sweep.sh 2>&1 | tee -a "$log"

echo "== mla defaults" | tee -a "$log"
timeout 200 python3 -m segkv.bench.mla_decode --skip-layer --heads 16,128 --batches 1,2,8,32 \
  --contexts 2048,8192,32768,131072 --dtypes bfloat16 --trials 3 2>&1 | grep -E "^\[|slower|Error" \
  | sed 's/max_rel_err=[^ ]*//' | tee -a "$log"

echo "== end to end" | tee -a "$log"
timeout 200 python3 -m segkv.bench.decode_e2e --models llama-3.1-8b,deepseek-v2-lite --batches 1,8 --contexts 1K,16K \
  --skip-hf 2>&1 | grep -E "^\[" | tee -a "$log"
