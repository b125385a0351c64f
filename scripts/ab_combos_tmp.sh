source scripts/gpu_env.sh
for round in 1 2; do
  for cfg in narrow wide; do
    envs=(); [ $cfg = wide ] && envs=(SEGKV_ATTENTION_WIDE_OFFSETS=1)
    echo "-- $cfg round $round"
    env ${envs[@]+"${envs[@]}"} timeout 100 python3 -m segkv.bench.decode_attention --shapes llama3-8b,llama3-70b \
      --batches 1,4,16 --contexts 32768 --page-sizes 16,32,64 --trials 3 --no-cascade 2>&1 | grep -E "^\[|rror" \
      | sed -E 's/ single=[^ ]*//; s/ segments2.*sdpa_flash/ sdpa_flash/; s/sdpa_efficient.*//; s/sdpa_cudnn=[^ ]*//'
  done
done 2>&1 | tee $OUT/combos3.txt
