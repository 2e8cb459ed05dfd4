#!/usr/bin/env bash
# One GPU verification run on a machine without a package index (torch, Triton, pytest, pytest-xdist
# preinstalled): install the project's packages without dependencies, then run the steps asked for, in order:
#   core-gpu     core's GPU tests (CUDA graphs, torch.compile, determinism, several GPUs), one process, stopping
#                at the first failure with its message;
#   conformance  the conformance suites of all three backends (bi100's policy forced: it runs on any GPU),
#                in parallel workers; conformance=sm80,bi100 runs the named backends' suites only;
#   fuzz=N       N random cases against the reference on the selected backend;
#   bench        `pagedprefill bench` on both layouts with the same-run peers, host overhead and a chart;
#   bench-context  the same for the context-scaling suite (2 x 1024 new tokens on 8k, 32k and 128k cached);
#   hopper       ci/gpu/hopper_check.py: sm80's Hopper kernel against the reference on a spread of cases, and
#                its schedule variants timed against the portable kernel (sm90 only); HOPPER_CHECK_ARGS are its
#                arguments (default "--quick": four workloads; "" times the whole suite; "--quick --schedule
#                OVERLAP=1" checks that schedule's correctness);
#   hopper-schedules  the Hopper kernel's correctness under each schedule of HOPPER_SCHEDULES (separated by ';',
#                e.g. "PINGPONG=1;PINGPONG=1,OVERLAP=1"), one process per schedule at the same time, no timing;
#   hopper-conformance  sm80's conformance suite with the Hopper kernel forced (sm90 only), a short sweep;
#   guard-cost   ci/gpu/guard_cost.py: the portable and Hopper kernels' memory-safety guards timed on the bench suite;
#   host-overhead  ci/gpu/host_overhead.py on both layouts: the host's time per call, layer by layer;
#   tune         `pagedprefill tune` on its default keys into OUTDIR/tuned.json (a table to review before it
#                replaces the shipped tuned/sm90.json), timed.
# Usage: ci/gpu/verify.sh OUTDIR [step ...]   (default: core-gpu conformance fuzz=2000 bench)
# STEP_TIMEOUT bounds each test step (seconds, default 600) and DEADLINE (a time in seconds since the epoch) the
# whole run, so that a run cut short still writes its logs; COMMIT names the commit the bench records.
# PAGEDPREFILL_SM80_SCHEDULE (e.g. "KEY_LOADS=1") runs every step with those flags of sm80's Hopper kernel.
set -u
out=${1:-/tmp/pagedprefill-gpu}; shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1: the packages are installed already
  for p in packages/core packages/backend-*; do
    python3 -m pip install -q --no-deps --no-build-isolation -e "$p" >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
  done
fi
python3 -m pagedprefill info | tee "$out/info.txt"
# A verbose pytest log's failures and totals, and how many tests finished (for a run its time limit cut).
results() {
  grep -E "(^| )(FAILED|ERROR) |^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$1" | tail -n 30
  echo "finished: $(grep -cE ' (PASSED|FAILED|SKIPPED|ERROR) ' "$1") tests"
}
rc=0
for step in ${*:-core-gpu conformance fuzz=2000 bench}; do
  limit=${STEP_TIMEOUT:-600}
  if [ -n "${DEADLINE:-}" ]; then
    left=$(( DEADLINE - $(date +%s) ))
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -lt 10 ] && { echo "=== $step: not run, the deadline has passed"; rc=1; continue; }
  fi
  echo "=== $step ($limit s at most)"
  case $step in
    core-gpu)
      timeout "$limit" python3 -m pytest -q -x -rfs -p no:cacheprovider -p no:xdist packages/core/tests/gpu \
        --ignore=packages/core/tests/gpu/test_fuzz_gpu.py --pagedprefill-device=cuda >"$out/core-gpu.log" 2>&1 || rc=1
      tail -n 40 "$out/core-gpu.log" ;;
    conformance|conformance=*)
      workers=${WORKERS:-$(( $(nproc) > 4 ? $(nproc) - 4 : 1 ))}
      names=generic,sm80,bi100; [ "$step" = conformance ] || names=${step#conformance=}
      suites=$(for n in ${names//,/ }; do printf 'packages/backend-%s/tests ' "$n"; done)
      # -v: one line per finished test, so a run cut by its time limit still names what failed.
      # worksteal: an idle worker takes queued tests from a busy one (the sweep parts run minutes each).
      timeout "$limit" python3 -m pytest -v -rfEs --durations=15 -p no:cacheprovider -n "$workers" --dist worksteal $suites \
        --pagedprefill-device=cuda >"$out/conformance.log" 2>&1 || rc=1
      results "$out/conformance.log" ;;
    fuzz=*)
      timeout "$limit" python3 -m pytest -q -s -p no:cacheprovider -p no:xdist packages/core/tests/gpu/test_fuzz_gpu.py \
        --pagedprefill-device=cuda --pagedprefill-fuzz="${step#fuzz=}" >"$out/fuzz.log" 2>&1 || rc=1
      tail -n 8 "$out/fuzz.log" ;;
    bench)
      timeout "$limit" python3 -m pagedprefill bench --layout both --no-reference --reps 100 \
        --commit "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" --json "$out/bench.json" --png "$out/bench.png" \
        2>"$out/bench.log" | tee "$out/bench.txt" || rc=1 ;;
    bench-context)
      timeout "$limit" python3 -m pagedprefill bench --suite context --layout both --no-reference --reps 100 \
        --no-host-overhead --commit "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" \
        --json "$out/bench-context.json" --png "$out/bench-context.png" 2>"$out/bench-context.log" \
        | tee "$out/bench-context.txt" || rc=1 ;;
    hopper)
      timeout "$limit" python3 ci/gpu/hopper_check.py --reps 60 ${HOPPER_CHECK_ARGS---quick} >"$out/hopper_check.log" 2>&1 || rc=1
      sed -n '/^correctness/,$p' "$out/hopper_check.log" ;;
    hopper-schedules)
      n=0; pids=()
      IFS=';' read -ra schedules <<<"${HOPPER_SCHEDULES:-PINGPONG=1}"
      for schedule in "${schedules[@]}"; do
        n=$((n + 1))
        timeout "$limit" python3 ci/gpu/hopper_check.py --no-timing --schedule "$schedule" \
          >"$out/hopper_schedule_$n.log" 2>&1 &
        pids+=($!)
      done
      for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || rc=1
        echo "--- schedule ${schedules[$i]}: $(grep -c '| ok |' "$out/hopper_schedule_$((i + 1)).log") of" \
             "$(grep -c '^| ' "$out/hopper_schedule_$((i + 1)).log") cases ok"
        grep -E '^\| .*(FAIL|ERROR)' "$out/hopper_schedule_$((i + 1)).log" | head -n 8
        tail -n 3 "$out/hopper_schedule_$((i + 1)).log" | grep -E 'Error|error' || true
      done ;;
    hopper-conformance)
      workers=${WORKERS:-$(( $(nproc) > 4 ? $(nproc) - 4 : 1 ))}
      timeout "$limit" python3 -m pytest -v -rfEs -p no:cacheprovider -p no:benchmark -n "$workers" --dist worksteal \
        packages/backend-sm80/tests/test_sm80_hopper_conformance.py --pagedprefill-device=cuda \
        --pagedprefill-sweep="${SWEEP:-16}" >"$out/hopper-conformance.log" 2>&1 || rc=1
      results "$out/hopper-conformance.log" ;;
    guard-cost)
      timeout "$limit" python3 ci/gpu/guard_cost.py --reps 60 --rounds 5 >"$out/guard_cost.log" 2>&1 || rc=1
      sed -n '/^kernel | workload | layout/,$p' "$out/guard_cost.log" ;;
    host-overhead)
      for layout in split nhd; do
        timeout "$limit" python3 ci/gpu/host_overhead.py "$layout" 2>&1 | tee -a "$out/host_overhead.log" || rc=1
      done ;;
    tune)
      started_tune=$(date +%s)
      timeout "$limit" python3 -m pagedprefill tune --out "$out/tuned.json" >"$out/tune.txt" 2>"$out/tune.log" || rc=1
      cat "$out/tune.txt"; tail -n 3 "$out/tune.log"
      echo "tune: $(( $(date +%s) - started_tune )) s" ;;
    *) echo "unknown step $step (core-gpu, conformance[=BACKENDS], fuzz=N, bench, bench-context, hopper, hopper-schedules, hopper-conformance, guard-cost, host-overhead, tune)"; rc=2 ;;
  esac
done
exit $rc
