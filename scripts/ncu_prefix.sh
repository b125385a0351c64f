#!/usr/bin/env bash
# Nsight Compute counters of the cascade prefix probe's Gluon programs (GPU machine): how busy the
# tensor, FMA and ALU pipes are (and XU, ex2, where ncu names it), the issue rate and the stall reasons per issued
# instruction, for the whole kernel, its math alone (reads cut after three tiles) and its reads alone,
# each with P in two bf16 parts (the numerical contract) and in one. Results under $OUT/ncu_prefix.txt.
#   usage: bash scripts/ncu_prefix.sh [variants]   (variant names of scripts/gluon_tall_probe.py, the
#          engine's Triton calls triton_cascade and triton_batch1 among them)
#          bash scripts/ncu_prefix.sh --source [variants]: instead, the warp-state samples of each
#          variant's second launch per SASS instruction, in $OUT/source_<variant>.csv (summarise them
#          with scripts/ncu_source_summary.py), beside the report $OUT/source_<variant>.ncu-rep
#          bash scripts/ncu_prefix.sh --source-engine: the same for the engine's Triton stage 1 (its
#          _stage1_kernel launch) over the probe's data: the cascade's prefix (triton_cascade) and
#          batch-1 decode over the same pages (triton_batch1), in $OUT/source_triton_*.csv
# Metrics this ncu does not know are left out (their names vary between versions).
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh"
source_page() {  # report name: the per-instruction samples as CSV, or the details page where that fails
  ncu --import "$OUT/$1.ncu-rep" --page source --print-source sass --csv > "$OUT/$1.csv" 2> "$OUT/$1.err" \
    || ncu --import "$OUT/$1.ncu-rep" --page details --print-details all > "$OUT/$1.txt" 2>&1
  echo "$1: $(wc -l < "$OUT/$1.csv") source lines"
}
probe_kernels="tall_prefix|stream_prefix|dual_prefix"  # the probe's Gluon kernels; the engine's is _stage1_kernel
if [ "${1:-}" = --source ] || [ "${1:-}" = --source-engine ]; then
  kernels=$probe_kernels variants=${2:-gluon_n64_o1_p33,gluon_n64_o1_p33_math}
  [ "$1" = --source-engine ] && kernels=_stage1_kernel variants=triton_cascade,triton_batch1
  for variant in ${variants//,/ }; do
    ncu --clock-control none --kernel-name regex:"$kernels" --launch-skip 1 \
      --launch-count 1 --section SourceCounters --section WarpStateStats --import-source no -f \
      -o "$OUT/source_$variant" python3 scripts/gluon_tall_probe.py --groups math,residency,dual --once "$variant" \
      2>&1 | grep -E "^==ERROR|rror" | head -5
    source_page "source_$variant"
  done
  exit 0
fi
default=gluon_n64_o1_p33,gluon_n64_o1_p33_math,gluon_n64_o1_p33_1p,gluon_n64_o1_p33_math_1p,stream_n64_p33_b3
default=$default,gluon_n64_o1_p17_math,dual_n32_p33_math
variants=${1:-$default}
known=$(ncu --query-metrics 2>/dev/null | awk '{print $1}')
# the metrics scripts/ncu_kernels.sh collects, then the rest only where ncu lists them
# shellcheck source=scripts/ncu_metrics.sh
source scripts/ncu_metrics.sh  # from the repository root (cd above)
for m in sm__cycles_elapsed.avg sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
         sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active \
         sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active \
         sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active \
         sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active \
         sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active \
         sm__ops_path_tensor_src_bf16_dst_fp32.sum; do
  grep -qx "${m%%.*}" <<<"$known" && metrics="$metrics,$m"
done
for stall in membar selected sleeping misc drain; do
  m="smsp__average_warps_issue_stalled_${stall}_per_issue_active"
  grep -qx "$m" <<<"$known" && metrics="$metrics,$m.ratio"
done
echo "metrics: $metrics" > "$OUT/ncu_prefix.txt"
timeout 400 ncu --clock-control none --kernel-name regex:"$probe_kernels|_stage1_kernel" \
  --metrics "$metrics" \
  python3 scripts/gluon_tall_probe.py --groups math,residency,dual --once "$variants" 2>&1 \
  | grep -vE "^==PROF==|^\s*$|-{5}" \
  | short_stall_names \
  | tee -a "$OUT/ncu_prefix.txt"
