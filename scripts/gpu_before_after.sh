#!/usr/bin/env bash
# The headline figures of two trees in one run on one GPU, results under $OUT: whole-model decode
# at batch 1 (Llama-3.1-8B and DeepSeek-V2-Lite shapes, random weights, 1K and 16K) and decode
# attention on the 8B shape at batch 1 and 16, 32K. The runs alternate (before, after, after,
# before) so that a drift of the card's clocks falls on both.
#   BASE   the earlier tree, extracted here (ignored by git; carry it):
#            mkdir .baseline && git archive <rev> -- segkv scripts pyproject.toml ':!segkv/default_models' \
#              | tar -x -C .baseline
#          Its benchmarks run as segkv.bench.* when it has no top-level benchmarks/ package.
#   SEGKV_BA_E2E  non-empty: skip the whole-model part; SEGKV_BA_ATTN non-empty: skip attention.
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
BASE=${BASE:-.baseline}
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' \
  | tee "$OUT/env.txt"

bench() {  # tree name module args...: one benchmark of one tree, its own segkv on the path
  local tree=$1 name=$2 module=$3; shift 3
  local root=$PWD prefix=benchmarks
  [ "$tree" != . ] && root=$PWD/$tree
  [ -d "$root/benchmarks" ] || prefix=segkv.bench
  (cd "$root" && PYTHONPATH="$root:${PYTHONPATH#"$PWD"}" timeout 300 python3 -m "$prefix.$module" \
    --json "$OUT/$name.json" "$@" 2>&1 | tail -25 | tee "$OUT/$name.txt")
}

if [ -z "${SEGKV_BA_ATTN:-}" ]; then
  for run in base:before_attn_1 head:after_attn_1 head:after_attn_2 base:before_attn_2; do
    tree=.; [ "${run%%:*}" = base ] && tree=$BASE
    bench "$tree" "${run#*:}" decode_attention --shapes llama3-8b --batches 1,16 --contexts 32768 \
      --page-sizes 16 --no-cascade --trials 5
  done
fi
if [ -z "${SEGKV_BA_E2E:-}" ]; then
  for run in base:before_e2e head:after_e2e; do
    tree=.; [ "${run%%:*}" = base ] && tree=$BASE
    bench "$tree" "${run#*:}" decode_e2e --skip-hf --trials 3 --models llama-3.1-8b,deepseek-v2-lite \
      --batches 1 --contexts 1K,16K
  done
fi
ls "$OUT"
