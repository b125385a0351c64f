#!/usr/bin/env bash
# Open questions of the kernels, measured in one go on the GPU machine (about 6 minutes);
# results under $OUT. Each experiment is a few quick benchmark runs under environment overrides
# (docs/configuration.md), so the defaults change only after a measurement.
#   Programmatic dependent launch (SEGKV_TRITON_PDL, 1 = on): the merge (and the next stage 1)
#   scheduled while the kernel before it finishes, waiting in-kernel for its results. Off/on for
#   GQA and latent decode and whole-model decode; then the GPU tests of the touched kernels
#   (a slice of the kernel grids, every other kernel test, CUDA graphs with PDL inside).
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
for pdl in 0 1; do
  SEGKV_TRITON_PDL=$pdl gqa "PDL $pdl" 1,4,16 32768,131072 llama3-8b
done
mla() {  # $1: label; environment set by the caller
  echo "== mla $1" | tee -a "$log"
  timeout 120 python3 -m segkv.bench.mla_decode --skip-layer --heads 16,128 --batches 1,8 \
    --contexts 32768,131072 --dtypes bfloat16 --trials 3 2>&1 | grep -E "^\[|slower|Error" \
    | sed 's/max_rel_err=[^ ]*//; s/ torch_default=[^ ]*//' | tee -a "$log"
}
for pdl in 0 1; do SEGKV_TRITON_PDL=$pdl mla "PDL $pdl"; done
for pdl in 0 1; do
  echo "== end to end, PDL $pdl" | tee -a "$log"
  SEGKV_TRITON_PDL=$pdl timeout 150 python3 -m segkv.bench.decode_e2e --models llama-3.1-8b,deepseek-v2-lite --batches 1 \
    --contexts 1K,16K --skip-hf 2>&1 | grep -E "^\[" | tee -a "$log"
done
if ! python3 -c 'import pytest' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
echo "== GPU tests (PDL on)" | tee -a "$log"
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_triton_mla.py tests/test_cuda_graphs.py \
  -k "not (kernels_match_the_reference or latent_kernel_matches) or (kernels_match_the_reference and bf16 and 128) or (latent_kernel_matches and bf16)" 2>&1 | tail -15 | tee -a "$log"
