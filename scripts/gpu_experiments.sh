#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 2 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. Why the 70B shape (8 query heads per KV head) runs batch 16 about 4% slower than the 8B
#      shape (4 per KV head) over the same bytes: both shapes at today's launch, with a register
#      cap of 168 (the 8B kernel compiles to 232 registers on Triton 3.6, the 70B one to 168), and
#      with the KV heads of a piece launched apart (SEGKV_TRITON_HEADS_FASTEST=0), alternating.
# Results of earlier runs: docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/segkv-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$OUT/experiments.txt"
: > "$log"
bench() {
  timeout 100 python3 -m segkv.bench.decode_attention --no-cascade --trials 3 --shapes llama3-8b,llama3-70b \
    --page-sizes 32 --batches 16 --contexts 16384,65536 2>&1 | grep -E "^\[" \
    | sed -E 's/ sdpa_efficient=[^ ]+//; s/ segments[0-9]+=[^ ]+//g; s/ single=[^ ]+//; s/ auto_segments8=[^ ]+//' | tee -a "$log"
}
for i in 1 2; do
  echo "== today's launch, run $i" | tee -a "$log"; bench
  echo "== register cap 168, run $i" | tee -a "$log"; SEGKV_TRITON_MAXNREG=168 bench
  echo "== KV heads apart, run $i" | tee -a "$log"; SEGKV_TRITON_HEADS_FASTEST=0 bench
done
