#!/usr/bin/env bash
# Several lists of ci/gpu/verify.sh steps at the same time on one machine, each with its own environment and
# log folder, all bounded by one deadline: the packages are installed once, a progress line comes every 45 s
# (tests finished and failed per suite log), and at the end each list's console output is printed and every
# log is packed into OUTDIR/logs.tgz (one file, for a machine that hands back few).
# Usage: ci/gpu/verify_together.sh OUTDIR SECONDS "[VAR=value ...] -- STEP ..." ...
#   e.g. ci/gpu/verify_together.sh /tmp/run 540 "WORKERS=10 -- conformance" "-- hopper bench"
# Lists share the GPU (and the CPU: give suites WORKERS that leave cores to the others); CUDA_VISIBLE_DEVICES
# in a list's variables puts it on a GPU of its own.
set -u
out=${1:?usage: ci/gpu/verify_together.sh OUTDIR SECONDS "[VAR=value ...] -- STEP ..." ...}
budget=${2:?the seconds every list must end within}
shift 2
started=$(date +%s)
export PYTHONUNBUFFERED=1 SKIP_INSTALL=1 DEADLINE=$(( started + budget ))
mkdir -p "$out"
for p in packages/core packages/backend-*; do
  python3 -m pip install -q --no-deps --no-build-isolation -e "$p" >>"$out/install.log" 2>&1 \
    || { tail -n 20 "$out/install.log"; exit 1; }
done
echo "installed in $(( $(date +%s) - started )) s"
n=0
pids=()
for list in "$@"; do
  n=$(( n + 1 ))
  # Split at the first " -- " only: variable values may hold "--" themselves (HOPPER_CHECK_ARGS=--only=D64).
  case "$list" in
    "-- "*) vars=""; steps=${list#-- } ;;
    *" -- "*) vars=${list%% -- *}; steps=${list#* -- } ;;
    *) echo "list $n: expected \"[VAR=value ...] -- STEP ...\", got \"$list\""; exit 2 ;;
  esac
  # shellcheck disable=SC2086  # the variables and steps are word lists
  env $vars bash "$(dirname "$0")/verify.sh" "$out/list$n" $steps >"$out/list$n.txt" 2>&1 &
  pids+=($!)
done
progress() {
  local line="+$(( $(date +%s) - started )) s:"
  for log in "$out"/list*/conformance.log "$out"/list*/hopper-conformance.log; do
    [ -f "$log" ] || continue
    line+=" ${log#"$out"/} $(grep -cE ' (PASSED|FAILED|SKIPPED|ERROR) ' "$log") done,"
    line+=" $(grep -cE ' (FAILED|ERROR) ' "$log") failed;"
  done
  for log in "$out"/list*/hopper_schedule_*.log "$out"/list*/hopper_check.log; do
    [ -f "$log" ] && line+=" ${log#"$out"/} $(grep -c '^| ' "$log") rows;"
  done
  echo "$line"
}
while :; do
  running=0
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && running=1; done
  [ "$running" = 0 ] && break
  sleep 45
  progress
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
for i in $(seq 1 "$n"); do
  echo "######## list $i: ${!i}"
  cat "$out/list$i.txt"
done
tar czf "$out/logs.tgz" -C "$out" --exclude logs.tgz . 2>/dev/null
echo "all lists done in $(( $(date +%s) - started )) s; logs in $out/logs.tgz"
exit $rc
