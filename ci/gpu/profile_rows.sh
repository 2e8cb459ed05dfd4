#!/usr/bin/env bash
# Hardware counters of bench workloads on sm80's Hopper kernel, one launch each after warm-up, condensed into one
# log (LOGFILE; everything the profiler printed goes to LOGFILE.raw): duration, throughputs, L2 requests and
# sectors, issue activity, the tensor and special-function pipes' activity and the largest warp-stall reasons.
# Usage: ci/gpu/profile_rows.sh LOGFILE NAME:LAYOUT[:SCHEDULE[:PEER]] ...
#   e.g. "long:nhd" "window:nhd" "prefix:split:WIDE_KEY_CHUNKS=1" "prefix:engine" "prefix:engine::fa4"
# NAME is part of a workload's name (ci/gpu/profile_workload.py); LAYOUT is nhd, split or engine (the serving
# engine's form on NHD; with SUITE=engine the engine suite's rows); SCHEDULE is its --schedule; PEER (fa4 or
# fa4-contig) profiles FlashAttention-4's kernel on the engine's form instead of ours. STEP_TIMEOUT bounds each
# row (seconds, default 150). Needs the profiler on PATH; the clocks are left as they are.
set -u
log=${1:?usage: profile_rows.sh LOGFILE NAME:LAYOUT[:SCHEDULE[:PEER]] ...}; shift
raw=$(mktemp)
rc=0
for row in "$@"; do
  IFS=: read -r name layout schedule peer <<<"$row"
  form=(--layout "$layout"); kernels=regex:hopper_prefill
  [ "$layout" = engine ] && form=(--engine)
  [ -n "$peer" ] && { form=(--peer "$peer"); kernels='regex:flash|Flash'; }
  echo "=== $name $layout schedule: ${schedule:-as the policy sets}${peer:+ peer: $peer}" | tee -a "$log"
  # --page raw prints every collected metric by name: the stall reasons too, which the details page summarises.
  timeout "${STEP_TIMEOUT:-150}" ncu --clock-control none -k "$kernels" --launch-skip 3 --launch-count 1 \
    --set full --metrics lts__t_requests.sum,lts__t_sectors.sum --page raw \
    python3 ci/gpu/profile_workload.py "$name" --suite "${SUITE:-default}" "${form[@]}" \
    ${schedule:+--schedule "$schedule"} >"$raw" 2>&1 \
    || { echo "profiler failed (exit $?):"; tail -n 5 "$raw"; rc=1; }
  cat "$raw" >>"$log.raw"  # everything, for what the summary below leaves out
  grep -E "TFLOP/s over|gpu__time_duration.sum|lts__t_requests.sum |lts__t_sectors.sum |lts__throughput.avg.pct_of_peak|sm__throughput.avg.pct_of_peak|smsp__issue_active.avg.pct|smsp__average_warp_latency_per_inst_issued|launch__registers_per_thread " "$raw" | tee -a "$log"
  # The six largest stall reasons: each one's warps stalled per issued instruction (they add up to the cycles
  # between a warp's instructions, smsp__average_warp_latency_per_inst_issued).
  grep -E "smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active\.ratio" "$raw" | awk '{ print $NF "\t" $0 }' \
    | sort -g -r | cut -f2- | head -n 6 | tee -a "$log"
  grep -E "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active |sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active " \
    "$raw" | tee -a "$log"
done
rm -f "$raw"
exit $rc
