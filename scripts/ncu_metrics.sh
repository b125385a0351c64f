# Sourced by scripts/ncu_kernels.sh: the Nsight Compute metrics it collects (time, grid, DRAM,
# registers, resident warps, issue rate, tensor pipe and the stall reasons per issued instruction),
# known to this GPU machine's ncu, in $metrics; and short_stall_names, a filter that cuts the stall
# metrics' names down to the reason.
metrics=launch__grid_size,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics=$metrics,launch__registers_per_thread,sm__warps_active.avg.per_cycle_active
metrics=$metrics,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum
metrics=$metrics,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active
for stall in long_scoreboard short_scoreboard wait barrier math_pipe_throttle mio_throttle not_selected \
             dispatch_stall lg_throttle no_instruction branch_resolving; do
  metrics="$metrics,smsp__average_warps_issue_stalled_${stall}_per_issue_active.ratio"
done
short_stall_names() { sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//; s/ +/ /g'; }
