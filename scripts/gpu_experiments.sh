#!/usr/bin/env bash
# Open questions, measured in one go on the GPU machine (about 9 minutes); results under
# $OUT/experiments.txt. Defaults change only after a measurement.
#   1. The kernel tests of the two changes below (atomics and tickets on real hardware).
#   2. Narrow tiles for small work items (SEGKV_TRITON_NARROW_M=16 against 0): the cascade's
#      fork rows beside the shared prefix's 64-pair tiles, two alternating runs each.
#   3. The merge inside stage 1 for decode rows of at most 4 partials (SEGKV_MERGE_IN_STAGE1_MAX=4
#      against 0): batch 16 of both shapes, and whole-model decode at batch 8 / 32 (whose graph
#      also loses the merge launch that zeroed padding rows).
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
timeout 170 python3 -m pytest -q -p no:cacheprovider -x tests/test_triton_attention.py tests/test_cuda_graphs.py \
  -k "stage1 or narrow or pipeline or graph or fully_masked or mixed or many_partials" 2>&1 | tail -3 | tee -a "$log"

for i in 1 2; do
  for narrow in 0 16; do
    echo "== cascade, narrow tiles $narrow (run $i)" | tee -a "$log"
    SEGKV_TRITON_NARROW_M=$narrow timeout 60 python3 -m segkv.bench.decode_attention --cascade-only --trials 5 \
      2>&1 | grep -E "^cascade|^  " | tee -a "$log"
  done
done
echo "== cascade, narrow tiles 16, prefix partition caps" | tee -a "$log"
timeout 90 python3 -m segkv.bench.decode_attention --cascade-only --trials 5 --cascade-caps 25,33,66 \
  2>&1 | grep -E "^cascade|^  " | tee -a "$log"

for i in 1 2; do
  for merge in 0 4; do
    echo "== batch 16, merge in stage 1 up to $merge partials (run $i)" | tee -a "$log"
    SEGKV_MERGE_IN_STAGE1_MAX=$merge timeout 75 python3 -m segkv.bench.decode_attention --no-cascade --trials 3 \
      --shapes llama3-8b,llama3-70b --page-sizes 32 --batches 16 --contexts 16384,131072 2>&1 | grep -E "^\[" \
      | sed -E 's/ sdpa_efficient=[^ ]+//; s/ segments[0-9]+=[^ ]+//g' | tee -a "$log"
  done
done

for merge in 0 4; do
  echo "== llama-3.1-8b decode, merge in stage 1 up to $merge partials" | tee -a "$log"
  SEGKV_MERGE_IN_STAGE1_MAX=$merge timeout 80 python3 -m segkv.bench.decode_e2e --models llama-3.1-8b \
    --batches 8,32 --contexts 1K,16K --skip-hf --trials 3 --json "$OUT/e2e_merge$merge.json" 2>&1 | grep -E "^\[" \
    | tee -a "$log"
done
python3 - "$OUT"/e2e_merge*.json <<'PY' 2>&1 | tee -a "$log"
import json, sys
def walk(x, name):
    if isinstance(x, dict):
        if "tokens_equal_eager" in x:
            print(name, x.get("batch"), x.get("context"), "equal", x["tokens_equal_eager"],
                  "fallbacks", x.get("graph_fallbacks"), "replays", x.get("graph_replays"))
        for v in x.values():
            walk(v, name)
    elif isinstance(x, list):
        for v in x:
            walk(v, name)
for path in sys.argv[1:]:
    walk(json.load(open(path)), path.rsplit("/", 1)[-1])
PY
