#!/usr/bin/env bash
# EAGLE-3 on the GPU machine, in stages (results under $OUT):
#   SEGKV_E3_STAGES  comma-separated; they run in this order (default: all):
#     tests      the Triton tree-mask and tree-window tests, and the runner's tree windows, on the GPU
#     attention  benchmarks.tree_attention (64 nodes over 32K against one decode row)
#     model      benchmarks.tree_attention --parts model (a 64-node tree verify at the 8B shape against a plain step)
#     e2e        benchmarks.spec_decode: eagle3 chains and trees on the built-in models, batch 1
#     train      retrain both built-in heads (tools.default_models.train_eagle3 --device cuda; copies under $OUT/heads)
#   SEGKV_E3_CASES   the e2e cases (default below)
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
stages=",${SEGKV_E3_STAGES:-tests,attention,model,e2e,train},"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
if [[ $stages == *,tests,* ]]; then
  timeout "${SEGKV_E3_TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider tests/attention/test_tree_windows.py tests/attention/test_tree_query_rows.py \
    tests/runner/test_tree_verify_rows.py tests/runner/test_cuda_graphs.py 2>&1 | tail -15 > "$OUT/tests.txt"
fi
if [[ $stages == *,attention,* ]]; then
  timeout 180 python3 -m benchmarks.tree_attention --json "$OUT/tree_attention.json" > "$OUT/tree_attention.txt" 2>&1
fi
if [[ $stages == *,model,* ]]; then
  timeout 180 python3 -m benchmarks.tree_attention --parts model --json "$OUT/tree_model.json" > "$OUT/tree_model.txt" 2>&1
fi
if [[ $stages == *,e2e,* ]]; then
  timeout 300 python3 -m benchmarks.spec_decode --parts e2e --ks 3 --batches 1 \
    --cases "${SEGKV_E3_CASES:-default:ngram,default:eagle3,default:eagle3@4x16,default-mla:eagle3,default-mla:eagle3@4x16}" \
    --json "$OUT/spec_eagle3.json" > "$OUT/spec_eagle3.txt" 2>&1
fi
if [[ $stages == *,train,* ]]; then
  timeout "${SEGKV_E3_TRAIN_S:-420}" python3 -m tools.default_models.train_eagle3 --device cuda 2>&1 | tail -60 > "$OUT/train.txt"
  mkdir -p "$OUT/heads" && cp -r segkv/default_models/eagle3-default segkv/default_models/eagle3-default-mla "$OUT/heads/"
fi
tail -3 "$OUT"/*.txt
