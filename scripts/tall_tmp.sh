source scripts/gpu_env.sh
old=(SEGKV_TRITON_TALL_BLOCK_N=64 SEGKV_TRITON_TALL_MAXNREG=0 SEGKV_CUDA_TALL_BLOCKS_PER_SM=2)
echo "-- cascade, tall programs 32 rows x 3 per SM (new default)"
timeout 30 python3 -m segkv.bench.decode_attention --cascade-only --trials 3 2>&1 | grep -E "cascade|rror" | head -3
echo "-- cascade, tall programs 64 rows x 2 per SM (before)"
env "${old[@]}" timeout 30 python3 -m segkv.bench.decode_attention --cascade-only --trials 3 2>&1 | grep -E "cascade|rror" | head -3
echo "-- prefill chunk 512 over 16K, new"
timeout 30 python3 scripts/profile_prefill.py --history 16384 --chunk 512 --rows 0 2>&1 | grep -E "^chunk|rror"
echo "-- prefill chunk 512 over 16K, before"
env "${old[@]}" timeout 30 python3 scripts/profile_prefill.py --history 16384 --chunk 512 --rows 0 2>&1 | grep -E "^chunk|rror"
