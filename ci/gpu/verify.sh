#!/usr/bin/env bash
# The GPU runner. On a machine without a package index (torch, Triton, pytest and pytest-xdist preinstalled)
# it installs the project's packages without dependencies (pip install --no-deps --no-build-isolation -e),
# prints `pagedprefill info`, then runs the named steps in order. Each step is bounded by `timeout` and logs
# to OUTDIR/<step>.log (a step's "=" and "," become "-": fuzz=5000 logs to fuzz-5000.log). A progress line
# comes every PROGRESS_EVERY seconds while a step runs, and one summary table at the end: step, status,
# seconds, the pytest summary line (or the step's own last word). A suite its limit cuts lists the tests it did
# not finish in OUTDIR/<step>-unfinished.txt (ci/gpu/unfinished_tests.py), node ids for a later run to take.
#
# Usage:
#   ci/gpu/verify.sh OUTDIR [OPTION ...] [STEP ...]        (default: core-gpu conformance fuzz=2000 bench)
#   ci/gpu/verify.sh OUTDIR [OPTION ...] --together "[VAR=value ...] -- STEP ..." "[VAR=value ...] -- STEP ..." ...
#   ci/gpu/verify.sh OUTDIR [OPTION ...] --two-gpus "[VAR=value ...] -- STEP ..." "[VAR=value ...] -- STEP ..."
#   ci/gpu/verify.sh --list
# e.g.  ci/gpu/verify.sh /tmp/run --deadline 540 --together "WORKERS=10 -- conformance-sm80" \
#         "PAGEDPREFILL_SM80_KERNEL=hopper -- hopper-conformance" "-- hopper bench"
#
# Options:
#   --list            print the steps below and exit
#   --dry-run         print what each step would run, then stop: nothing installed, nothing run
#   --no-install      the packages are installed already (also SKIP_INSTALL=1)
#   --deadline S      every step (of every list) ends within S seconds from now, so that a run cut short still
#                     writes its logs; a step with less than 10 s left is not run (also DEADLINE: a time in
#                     seconds since the epoch)
#   --step-timeout S  each step's limit, seconds (default 600; also STEP_TIMEOUT)
#   --pack            pack every log into OUTDIR/logs.tgz at the end (one file, for a machine that hands back
#                     few); --together and --two-gpus always do
#   --together LIST ...  several lists of steps at the same time on this machine, each with its own environment
#                     (the words before " -- "; a list without " -- " is all steps) and log folder OUTDIR/listN,
#                     its console output in OUTDIR/listN.txt. The packages are installed once, before the lists
#                     start. Lists share the GPU and the CPU: give suites WORKERS that leave cores to the others;
#                     CUDA_VISIBLE_DEVICES in a list's variables puts it on a GPU of its own. Values cannot hold
#                     spaces: set such variables (HOPPER_CHECK_ARGS="--quick --only D64") for all lists in the
#                     environment of this command instead.
#   --two-gpus LIST LIST  two lists at once, one per GPU of a two-GPU machine (CUDA_VISIBLE_DEVICES=0 and 1),
#                     in OUTDIR/gpu0 and OUTDIR/gpu1; WORKERS defaults to half the machine's cores less two
#
# Steps:
#   core-gpu            core's GPU tests but the fuzz (CUDA graphs, torch.compile, determinism, corrupt metadata,
#                       several GPUs), one process, stopping at the first failure with its message
#   conformance         the conformance suites of all three backends in one pytest run, WORKERS xdist workers
#   conformance=B,...   the named backends' suites only (e.g. conformance=sm80,bi100)
#   conformance-generic the generic backend's suite
#   conformance-sm80    sm80's suite (its forced-Hopper class included)
#   conformance-bi100   bi100's suite, the BI-V100 policy forced (its tests describe a BI-V100 to the policy, so
#                       it runs on any GPU)
#   hopper-conformance  sm80's conformance suite with the Hopper kernel forced (sm90 only), a sweep of SWEEP
#                       problems (default 16)
#   fuzz[=N]            N random cases against the reference on the selected backend (default 2000)
#   engine-fuzz[=N]     N random cases of the serving engine's call (k = v = None, pages of 16 and up, mixed
#                       decode, speculative and chunk rows) against the reference (default 5000); both fuzz
#                       steps share their cases among FUZZ_SHARDS processes when it is more than 1
#   bench               `pagedprefill bench` on both layouts with the same-run peers, host overhead and a chart
#                       (OUTDIR/bench.json, bench.png, bench.txt); COMMIT names the commit it records
#   bench-context       the same for the context-scaling suite (2 x 1024 new tokens on 8k, 32k and 128k cached)
#   hopper              ci/gpu/hopper_check.py: sm80's Hopper kernel against the reference on a spread of cases,
#                       and its schedule variants timed against the portable kernel (sm90 only);
#                       HOPPER_CHECK_ARGS are its arguments (default "--quick": four workloads; "" times the
#                       whole suite; "--no-timing --schedule FUSED_SCALE=0" checks that schedule's correctness)
#   hopper-schedules    the Hopper kernel's correctness under each schedule of HOPPER_SCHEDULES (separated by
#                       ';', e.g. "FUSED_SCALE=0;KEY_LOADS=0,VALUES_FIRST=0"), one process per schedule at the
#                       same time, no timing
#   guard-cost          ci/gpu/guard_cost.py: the portable and Hopper kernels' memory-safety guards timed on the
#                       bench suite
#   host-overhead[=L,...]  ci/gpu/host_overhead.py once per layout, one process each (default split,nhd; e.g.
#                       host-overhead=nhd,split,nhd,split): the host's time per call, layer by layer
#   tune                `pagedprefill tune` on its default keys into OUTDIR/tuned.json (a table to review before
#                       it replaces the shipped tuned/sm90.json)
#   nox[=S,...]         the noxfile's hardware sessions with --no-venv (default generic,sm80; also bi100,
#                       production), PYTEST_EXTRA passed to pytest; nox itself from .whl/*.whl carried in the
#                       tree when it is not installed
#
# Environment: WORKERS (xdist workers of the suites; default the cores less four), FUZZ_SHARDS (processes of
# the fuzz steps, default 1), STEP_TIMEOUT, DEADLINE,
# COMMIT, HOPPER_CHECK_ARGS, HOPPER_SCHEDULES, SWEEP, PYTEST_EXTRA, PROGRESS_EVERY (seconds, default 45), and
# the library's own: PAGEDPREFILL_SM80_KERNEL (hopper, portable) and PAGEDPREFILL_SM80_SCHEDULE (e.g.
# "KEY_LOADS=0") apply to every step of the list they are set for.
set -u
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

list_steps() { sed -n '/^# Steps:/,/^# Environment:/{/^# Environment:/d;s/^# \{0,1\}//;p}' "$self"; }
usage() { sed -n '2,/^set -u/{/^set -u/d;s/^# \{0,1\}//;p}' "$self"; }
die() { echo "verify.sh: $*" >&2; exit 2; }

# ---- the arguments
case ${1:-} in
  --list) list_steps; exit 0 ;;
  -h|--help|"") usage; [ -n "${1:-}" ]; exit $? ;;
  -*) die "the first argument is the output folder (or --list), got $1" ;;
esac
out=$1; shift
case $out in /*) ;; *) out=$PWD/$out ;; esac
cd "$(dirname "$self")/../.." || exit 2  # the repository's root: the steps name its paths
dry=0 pack=0 mode=single install=1
[ -n "${SKIP_INSTALL:-}" ] && install=0
steps=()
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) dry=1 ;;
    --no-install) install=0 ;;
    --pack) pack=1 ;;
    --deadline) [ $# -ge 2 ] || die "--deadline needs seconds"; DEADLINE=$(( $(date +%s) + $2 )); export DEADLINE; shift ;;
    --step-timeout) [ $# -ge 2 ] || die "--step-timeout needs seconds"; STEP_TIMEOUT=$2; export STEP_TIMEOUT; shift ;;
    --together) mode=together; shift; break ;;
    --two-gpus) mode=two-gpus; shift; break ;;
    --list) list_steps; exit 0 ;;
    --*) die "unknown option $1 (see ci/gpu/verify.sh --help)" ;;
    *) steps+=("$1") ;;
  esac
  shift
done
lists=("$@")

# ---- the steps
known_step() {
  case $1 in
    core-gpu|conformance|conformance-generic|conformance-sm80|conformance-bi100|hopper-conformance|fuzz|bench \
      |engine-fuzz \
      |bench-context|hopper|hopper-schedules|guard-cost|host-overhead|tune|nox) return 0 ;;
    conformance=*) [[ ${1#conformance=} =~ ^(generic|sm80|bi100)(,(generic|sm80|bi100))*$ ]] ;;
    fuzz=*) [[ ${1#fuzz=} =~ ^[0-9]+$ ]] ;;
    engine-fuzz=*) [[ ${1#engine-fuzz=} =~ ^[0-9]+$ ]] ;;
    host-overhead=*) [[ ${1#host-overhead=} =~ ^(split|nhd)(,(split|nhd))*$ ]] ;;
    nox=*) [[ ${1#nox=} =~ ^[a-z0-9_-]+(,[a-z0-9_-]+)*$ ]] ;;
    *) return 1 ;;
  esac
}
check_steps() {  # every step of a list known before anything runs: a typo costs no GPU time
  local step bad=()
  for step in "$@"; do known_step "$step" || bad+=("$step"); done
  [ ${#bad[@]} = 0 ] || die "unknown step(s): ${bad[*]} (ci/gpu/verify.sh --list names them)"
}

workers() { echo "${WORKERS:-$(( $(nproc) > 4 ? $(nproc) - 4 : 1 ))}"; }
commit() { echo "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"; }

# run CMD...: one command of the current step, bounded by what is left of the step's limit, its output appended
# to RUN_LOG (default the step's log; its stdout to RUN_OUT when set). Under --dry-run it only prints it.
run() {
  local target=${RUN_LOG:-$log}
  if [ "$dry" = 1 ]; then
    printf '  +'; printf ' %q' "$@"
    if [ -n "${RUN_OUT:-}" ]; then printf '  >>%s 2>>%s\n' "${RUN_OUT#"$out"/}" "${target#"$out"/}"
    else printf '  >>%s 2>&1\n' "${target#"$out"/}"; fi
    return 0
  fi
  local left=$(( step_end - $(date +%s) )) status=0
  [ "$left" -ge 1 ] || { echo "(not run: the step's time is up) $*" >>"$target"; step_rc=124; return 124; }
  if [ -n "${RUN_OUT:-}" ]; then
    timeout -k 20 "$left" "$@" >>"$RUN_OUT" 2>>"$target" || status=$?
  else
    timeout -k 20 "$left" "$@" >>"$target" 2>&1 || status=$?
  fi
  [ "$status" = 0 ] || [ "$step_rc" != 0 ] || step_rc=$status
  return "$status"
}
# report CMD...: what a finished step shows on the console (nothing under --dry-run).
report() { [ "$dry" = 1 ] || "$@"; }
# A verbose pytest log's failures and totals, and how many tests finished (for a run its time limit cut).
results() {
  grep -E "(^| )(FAILED|ERROR) |^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$1" | tail -n 30
  echo "finished: $(finished "$1") tests"
}
finished() { grep -cE ' (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)( |$)' "$1"; }

# unfinished LOG PYTEST_ARGS...: after a suite its limit cut, the node ids it did not finish into LOG's
# -unfinished.txt (the collection takes seconds of its own, past the step's limit).
unfinished() {
  [ "$dry" = 1 ] && return 0
  case $step_rc in 124|137) ;; *) return 0 ;; esac
  echo >>"$1"  # the cut run's last line may have no end
  timeout 90 "$PYTHON" ci/gpu/unfinished_tests.py "$1" --out "${1%.log}-unfinished.txt" -- "${@:2}" >>"$1" 2>&1 \
    || echo "(the unfinished tests could not be listed)" >>"$1"
}

conformance_suites() {  # BACKEND,... -> their test folders
  local n; for n in ${1//,/ }; do printf 'packages/backend-%s/tests ' "$n"; done
}
step_conformance() {  # BACKEND,...
  # -v: one line per finished test, so a run cut by its time limit still names what failed;
  # --pagedprefill-failures-now: and says why, each failure's report printed as it comes.
  # worksteal: an idle worker takes queued tests from a busy one (the sweep parts run minutes each).
  # shellcheck disable=SC2046  # the suites are a word list
  run "$PYTHON" -m pytest -v -rfEs --durations=15 -p no:cacheprovider -n "$(workers)" --dist worksteal \
    $(conformance_suites "$1") --pagedprefill-device=cuda --pagedprefill-failures-now
  # shellcheck disable=SC2046
  unfinished "$log" $(conformance_suites "$1") --pagedprefill-device=cuda
  report results "$log"
}

step_fuzz_shards() {  # CASES [--engine]: the fuzz shared among FUZZ_SHARDS processes on the GPU
  # The compile keys' kernels once, then each process runs its share of the one case stream (the reproducers
  # are a single run's), each logging to <step>-shardK.log; the step's log gets their totals and failures.
  local cases=$1 n=${FUZZ_SHARDS} k pids=() status total=0 failed=0 fuzz=("$PYTHON" -m pagedprefill.testing.fuzz
    --device cuda --cases "$1" "${@:2}")
  run "${fuzz[@]}" --compile-only
  for ((k = 0; k < n; k++)); do
    RUN_LOG="${log%.log}-shard$k.log" run "${fuzz[@]}" --shard "$k/$n" --compile-workers 0 &
    pids+=($!)
  done
  for k in "${!pids[@]}"; do
    status=0; wait "${pids[$k]}" || status=$?
    [ "$status" = 0 ] || [ "$step_rc" != 0 ] || step_rc=$status
  done
  [ "$dry" = 1 ] && return 0
  for ((k = 0; k < n; k++)); do
    local one="${log%.log}-shard$k.log" line
    line=$(grep -E '^fuzz: [0-9]+ cases, [0-9]+ failures' "$one" | tail -n 1)
    [ -n "$line" ] || line="fuzz: 0 cases, 0 failures (shard $k/$n did not finish: $(tail -n 1 "$one"))"
    total=$(( total + $(sed -E 's/^fuzz: ([0-9]+) cases.*/\1/' <<<"$line") ))
    failed=$(( failed + $(sed -E 's/^fuzz: [0-9]+ cases, ([0-9]+) failures.*/\1/' <<<"$line") ))
    { echo "shard $k/$n: $line"; grep '^FAIL ' "$one" | head -n 5; } >>"$log"
  done
  echo "fuzz: $total of $cases cases in $n processes, $failed failures" >>"$log"
  report tail -n $(( 2 * n + 2 )) "$log"
}

run_step() {  # STEP: its commands, with `log`, `step_end` and `step_rc` set by the caller
  local step=$1
  case $step in
    core-gpu)
      run "$PYTHON" -m pytest -q -x -rfs -p no:cacheprovider -p no:xdist packages/core/tests/gpu \
        --ignore=packages/core/tests/gpu/test_fuzz_gpu.py --pagedprefill-device=cuda
      report tail -n 40 "$log" ;;
    conformance) step_conformance generic,sm80,bi100 ;;
    conformance=*) step_conformance "${step#conformance=}" ;;
    conformance-*) step_conformance "${step#conformance-}" ;;
    hopper-conformance)
      run "$PYTHON" -m pytest -v -rfEs -p no:cacheprovider -p no:benchmark -n "$(workers)" --dist worksteal \
        packages/backend-sm80/tests/test_sm80_hopper_conformance.py --pagedprefill-device=cuda \
        --pagedprefill-sweep="${SWEEP:-16}" --pagedprefill-failures-now
      unfinished "$log" packages/backend-sm80/tests/test_sm80_hopper_conformance.py --pagedprefill-device=cuda \
        --pagedprefill-sweep="${SWEEP:-16}"
      report results "$log" ;;
    fuzz|fuzz=*)
      local cases=2000; [ "$step" = fuzz ] || cases=${step#fuzz=}
      if [ "${FUZZ_SHARDS:-1}" -gt 1 ]; then
        step_fuzz_shards "$cases"
      else
        run "$PYTHON" -m pytest -q -s -p no:cacheprovider -p no:xdist packages/core/tests/gpu/test_fuzz_gpu.py \
          --pagedprefill-device=cuda --pagedprefill-fuzz="$cases"
        report tail -n 8 "$log"
      fi ;;
    engine-fuzz|engine-fuzz=*)
      local cases=5000; [ "$step" = engine-fuzz ] || cases=${step#engine-fuzz=}
      if [ "${FUZZ_SHARDS:-1}" -gt 1 ]; then
        step_fuzz_shards "$cases" --engine
      else
        run "$PYTHON" -m pytest -q -s -p no:cacheprovider -p no:xdist packages/core/tests/gpu/test_fuzz_gpu.py \
          -k engine --pagedprefill-device=cuda --pagedprefill-fuzz-engine="$cases"
        report tail -n 8 "$log"
      fi ;;
    bench)
      RUN_OUT="$out/bench.txt" run "$PYTHON" -m pagedprefill bench --layout both --no-reference --reps 100 \
        --commit "$(commit)" --json "$out/bench.json" --png "$out/bench.png"
      report cat "$out/bench.txt" ;;
    bench-context)
      RUN_OUT="$out/bench-context.txt" run "$PYTHON" -m pagedprefill bench --suite context --layout both \
        --no-reference --reps 100 --no-host-overhead --commit "$(commit)" --json "$out/bench-context.json" \
        --png "$out/bench-context.png"
      report cat "$out/bench-context.txt" ;;
    hopper)
      # shellcheck disable=SC2086  # HOPPER_CHECK_ARGS is a word list
      run "$PYTHON" ci/gpu/hopper_check.py --reps 60 ${HOPPER_CHECK_ARGS---quick}
      report sed -n '/^correctness/,$p' "$log" ;;
    hopper-schedules)
      local schedules n pids=() status
      IFS=';' read -ra schedules <<<"${HOPPER_SCHEDULES:-PINGPONG=1}"
      for n in "${!schedules[@]}"; do
        RUN_LOG="${log%.log}-$((n + 1)).log" run "$PYTHON" ci/gpu/hopper_check.py --no-timing \
          --schedule "${schedules[$n]}" &
        pids+=($!)
      done
      for n in "${!pids[@]}"; do
        status=0; wait "${pids[$n]}" || status=$?
        [ "$status" = 0 ] || [ "$step_rc" != 0 ] || step_rc=$status
        [ "$dry" = 1 ] && continue
        local one="${log%.log}-$((n + 1)).log"
        { echo "--- schedule ${schedules[$n]}: $(grep -c '| ok |' "$one") of $(grep -c '^| ' "$one") cases ok"
          grep -E '^\| .*(FAIL|ERROR)' "$one" | head -n 8
          tail -n 3 "$one" | grep -E 'Error|error' || true; } | tee -a "$log"
      done ;;
    guard-cost)
      run "$PYTHON" ci/gpu/guard_cost.py --reps 60 --rounds 5
      report sed -n '/^kernel | workload | layout/,$p' "$log" ;;
    host-overhead|host-overhead=*)
      local layouts=split,nhd layout; [ "$step" = host-overhead ] || layouts=${step#host-overhead=}
      for layout in ${layouts//,/ }; do
        run "$PYTHON" ci/gpu/host_overhead.py "$layout"
      done
      report cat "$log" ;;
    tune)
      RUN_OUT="$out/tune.txt" run "$PYTHON" -m pagedprefill tune --out "$out/tuned.json"
      report cat "$out/tune.txt"; report tail -n 3 "$log" ;;
    nox|nox=*)
      local sessions=generic,sm80 session; [ "$step" = nox ] || sessions=${step#nox=}
      if ! "$PYTHON" -c "import nox" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
        run "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/pagedprefill-nox-site \
          .whl/*.whl && export PYTHONPATH=/tmp/pagedprefill-nox-site${PYTHONPATH:+:$PYTHONPATH}
      fi
      for session in ${sessions//,/ }; do
        # shellcheck disable=SC2086  # PYTEST_EXTRA is a word list
        run "$PYTHON" -m nox --no-venv -s "$session" -- ${PYTEST_EXTRA:-}
      done
      report tail -n 25 "$log" ;;
  esac
}

# One line for the summary table: pytest's own summary, else what the step's log ends with.
summary_line() {  # STEP LOG STATUS
  local line=""
  [ -f "$2" ] || { echo "-"; return; }
  line=$(grep -E '(passed|failed|errors?|skipped|deselected|no tests ran)' "$2" | grep -E ' in [0-9.]+s' | tail -n 1 \
    | sed -E 's/^=+ *//; s/ *=+$//')
  if [ -z "$line" ] && [ "$(finished "$2")" -gt 0 ]; then
    line="cut: $(finished "$2") tests finished, $(grep -cE ' (FAILED|ERROR)( |$)' "$2") failed"
  fi
  case $1 in
    hopper) [ -n "$line" ] || line="$(grep -c '^| .* | ok |$' "$2") of $(sed -n '/^correctness/,/^$/p' "$2" \
              | grep -c '^| ') cases ok" ;;
    hopper-schedules) line=$(grep -o '^--- schedule .*ok' "$2" | sed 's/^--- schedule //' | paste -sd ';' -) ;;
    bench|bench-context|tune) [ -f "${2%.log}.txt" ] && line=$(grep -v '^[[:space:]]*$' "${2%.log}.txt" | tail -n 1) ;;
  esac
  [ -n "$line" ] || line=$(grep -v '^[[:space:]]*$' "$2" | tail -n 1)
  [ -n "$line" ] || line="(no output)"
  [ "$3" != timeout ] || [[ $line == *" in "*s* ]] || line="cut by its time limit; its log ends: $line"
  line=${line//|//}; line=${line//$'\t'/ }
  echo "${line:0:110}"
}

# A line every PROGRESS_EVERY seconds while a step runs: its time, and its tests so far or its log's last line.
heartbeat() {  # STEP LOG
  local started=$(date +%s) every=${PROGRESS_EVERY:-45} now line nap=""
  trap '[ -n "$nap" ] && kill "$nap" 2>/dev/null; exit 0' TERM
  while :; do
    sleep "$every" & nap=$!
    wait "$nap"
    now=$(( $(date +%s) - started ))
    if [ -f "$2" ] && [ "$(finished "$2")" -gt 0 ]; then
      line="$(finished "$2") tests finished, $(grep -cE ' (FAILED|ERROR)( |$)' "$2") failed"
    elif [ -s "$2" ]; then
      line="log: $(tail -n 1 "$2" | cut -c1-100)"
    elif [ -f "$2" ]; then
      line="no output yet"
    else
      line="starting"
    fi
    echo "  ... $1 +${now} s: $line"
    echo "$1 +${now} s: $line" >"$out/progress.txt"
  done
}

print_table() {  # TSV with a header row -> a markdown table
  awk -F'\t' 'NR == 1 { h = "|"; s = "|"; for (i = 1; i <= NF; i++) { h = h " " $i " |"
                                                                       s = s ($i == "seconds" ? " ---: |" : " --- |") }
                        print h; print s; next }
              { r = "|"; for (i = 1; i <= NF; i++) r = r " " $i " |"; print r }' "$1"
}

install_packages() {
  local p
  for p in packages/core packages/backend-*; do
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e "$p" >>"$out/install.log" 2>&1 \
      || { tail -n 20 "$out/install.log"; exit 1; }
  done
}

run_steps() {  # the steps of one list, in order, into $out
  local step limit left started seconds status name count beat rc=0
  declare -A used=()
  [ "$dry" = 1 ] || printf 'step\tstatus\tseconds\tsummary\n' >"$out/summary.tsv"
  for step in "$@"; do
    name=$(printf '%s' "$step" | tr '=,' '--')
    count=${used[$name]:-0}; used[$name]=$(( count + 1 ))
    [ "$count" = 0 ] || name="$name.$(( count + 1 ))"  # a step asked for twice keeps both logs
    log="$out/$name.log"
    limit=${STEP_TIMEOUT:-600} left=999999
    if [ -n "${DEADLINE:-}" ]; then
      left=$(( DEADLINE - $(date +%s) ))
      [ "$left" -lt "$limit" ] && limit=$left
    fi
    if [ "$left" -lt 10 ] && [ "$dry" = 0 ]; then
      echo "=== $step: not run, the deadline has passed"
      printf '%s\tnot run\t0\tthe deadline had passed\n' "$step" >>"$out/summary.tsv"
      rc=1; continue
    fi
    echo "=== $step ($limit s at most, log ${log#"$out"/})"
    step_rc=0 step_end=$(( $(date +%s) + limit )) started=$(date +%s)
    if [ "$dry" = 1 ]; then run_step "$step"; continue; fi
    : >"$log"
    heartbeat "$step" "$log" &
    beat=$!
    run_step "$step"
    kill "$beat" 2>/dev/null; wait "$beat" 2>/dev/null
    seconds=$(( $(date +%s) - started ))
    case $step_rc in
      0) status=ok ;;
      124|137) status=timeout; rc=1 ;;
      *) status="failed (exit $step_rc)"; rc=1 ;;
    esac
    echo "=== $step: $status in $seconds s"
    echo "$step: $status in $seconds s" >"$out/progress.txt"
    printf '%s\t%s\t%s\t%s\n' "$step" "$status" "$seconds" "$(summary_line "$step" "$log" "$status")" \
      >>"$out/summary.tsv"
  done
  if [ "$dry" = 0 ]; then
    echo; echo "summary ($out):"; print_table "$out/summary.tsv"
  fi
  return $rc
}

# ---- one list
if [ "$mode" = single ]; then
  [ ${#lists[@]} = 0 ] || die "unexpected arguments after the steps: ${lists[*]}"
  [ ${#steps[@]} -gt 0 ] || steps=(core-gpu conformance fuzz=2000 bench)
  check_steps "${steps[@]}"
  if [ "$dry" = 1 ]; then
    echo "would run in $out, $([ "$install" = 1 ] && echo "after installing the packages" || echo "packages installed"):"
    run_steps "${steps[@]}"; exit 0
  fi
  mkdir -p "$out"
  [ "$install" = 1 ] && install_packages
  "$PYTHON" -m pagedprefill info | tee "$out/info.txt"
  rc=0; run_steps "${steps[@]}" || rc=1
  if [ "$pack" = 1 ]; then tar czf "$out/logs.tgz" -C "$out" --exclude logs.tgz . 2>/dev/null; fi
  exit $rc
fi

# ---- several lists at once
[ ${#steps[@]} = 0 ] || die "steps before --$mode: ${steps[*]} (give each list as one argument after it)"
[ ${#lists[@]} -gt 0 ] || die "--$mode needs at least one list"
[ "$mode" = two-gpus ] && [ ${#lists[@]} != 2 ] && die "--two-gpus takes two lists, got ${#lists[@]}"
vars=() words=() dirs=()
for i in "${!lists[@]}"; do
  list=${lists[$i]}
  # Split at the first " -- " only: variable values may hold "--" themselves (HOPPER_CHECK_ARGS=--only=D64).
  case "$list" in
    "-- "*) v=""; s=${list#-- } ;;
    *" -- "*) v=${list%% -- *}; s=${list#* -- } ;;
    *) v=""; s=$list ;;
  esac
  for word in $v; do [[ $word == *=* ]] || die "list $((i + 1)): \"$word\" before \" -- \" is not VAR=value"; done
  # shellcheck disable=SC2086  # the steps are a word list
  check_steps $s
  if [ "$mode" = two-gpus ]; then v="CUDA_VISIBLE_DEVICES=$i $v"; dirs+=("gpu$i"); else dirs+=("list$((i + 1))"); fi
  vars+=("$v"); words+=("$s")
done
if [ "$mode" = two-gpus ]; then export WORKERS=${WORKERS:-$(( $(nproc) / 2 > 2 ? $(nproc) / 2 - 2 : 1 ))}; fi
if [ "$dry" = 1 ]; then
  for i in "${!lists[@]}"; do
    echo "######## ${dirs[$i]}: env ${vars[$i]:-(none)}"
    # shellcheck disable=SC2086
    env ${vars[$i]} bash "$self" "$out/${dirs[$i]}" --dry-run --no-install ${words[$i]}
  done
  exit 0
fi
started=$(date +%s)
mkdir -p "$out"
# Installed once here: two installs into one environment at the same time would race.
[ "$install" = 1 ] && install_packages
echo "installed in $(( $(date +%s) - started )) s"
pids=()
for i in "${!lists[@]}"; do
  mkdir -p "$out/${dirs[$i]}"
  # shellcheck disable=SC2086  # the variables and steps are word lists
  env ${vars[$i]} bash "$self" "$out/${dirs[$i]}" --no-install ${words[$i]} >"$out/${dirs[$i]}.txt" 2>&1 &
  pids+=($!)
done
while :; do
  running=0
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && running=1; done
  [ "$running" = 0 ] && break
  sleep "${PROGRESS_EVERY:-45}"
  line="+$(( $(date +%s) - started )) s:"
  for i in "${!dirs[@]}"; do
    [ -f "$out/${dirs[$i]}/progress.txt" ] && line+=" ${dirs[$i]} $(cat "$out/${dirs[$i]}/progress.txt");"
  done
  echo "$line"
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
printf 'list\tstep\tstatus\tseconds\tsummary\n' >"$out/summary.tsv"
for i in "${!lists[@]}"; do
  echo "######## ${dirs[$i]}: ${lists[$i]}"
  cat "$out/${dirs[$i]}.txt"
  [ -f "$out/${dirs[$i]}/summary.tsv" ] && tail -n +2 "$out/${dirs[$i]}/summary.tsv" | sed "s/^/${dirs[$i]}\t/" \
    >>"$out/summary.tsv"
done
tar czf "$out/logs.tgz" -C "$out" --exclude logs.tgz . 2>/dev/null
echo; echo "all lists done in $(( $(date +%s) - started )) s; logs in $out/logs.tgz"
print_table "$out/summary.tsv"
exit $rc
