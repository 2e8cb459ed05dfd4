#!/usr/bin/env bash
# One GPU verification run on a machine without a package index (torch, Triton, pytest, pytest-xdist
# preinstalled): install the project's packages without dependencies, then
#   conformance  the conformance suites of all three backends (bi100's policy forced: it runs on any GPU)
#                and core's GPU tests (CUDA graphs, compile, determinism), in parallel workers;
#   fuzz         N random cases against the reference on the selected backend, beside the conformance run;
#   bench        `pagedprefill bench` on both layouts with the same-run peers, host overhead and a chart.
# Usage: ci/gpu/verify.sh OUTDIR [fuzz=N] [conformance] [bench]   (default: fuzz=2000 conformance bench);
# FUZZ_TIMEOUT / CONFORMANCE_TIMEOUT bound those steps (seconds, default 600).
set -u
out=${1:-/tmp/pagedprefill-gpu}; shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1
for p in packages/core packages/backend-*; do
  python3 -m pip install -q --no-deps --no-build-isolation -e "$p" >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
done
python3 -m pagedprefill info | tee "$out/info.txt"
steps=${*:-fuzz=2000 conformance bench}
rc=0
fuzz_pid=
for step in $steps; do
  case $step in
    fuzz=*)
      timeout "${FUZZ_TIMEOUT:-600}" python3 -m pytest -q -s -p no:cacheprovider packages/core/tests/gpu/test_fuzz_gpu.py --pagedprefill-device=cuda \
        --pagedprefill-fuzz="${step#fuzz=}" >"$out/fuzz.log" 2>&1 &
      fuzz_pid=$! ;;
    conformance)
      workers=$(( $(nproc) > 4 ? $(nproc) - 4 : 1 ))
      timeout "${CONFORMANCE_TIMEOUT:-600}" python3 -m pytest -q -rs -p no:cacheprovider -n "$workers" packages/backend-generic/tests packages/backend-sm80/tests \
        packages/backend-bi100/tests packages/core/tests/gpu --deselect packages/core/tests/gpu/test_fuzz_gpu.py \
        --pagedprefill-device=cuda >"$out/conformance.log" 2>&1 || rc=1
      tail -n 30 "$out/conformance.log" ;;
    bench)
      [ -n "$fuzz_pid" ] && { wait "$fuzz_pid" || rc=1; tail -n 5 "$out/fuzz.log"; fuzz_pid=; }
      python3 -m pagedprefill bench --layout both --no-reference --reps 100 --commit "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" \
        --json "$out/bench.json" --png "$out/bench.png" 2>"$out/bench.log" | tee "$out/bench.txt" || rc=1 ;;
  esac
done
[ -n "$fuzz_pid" ] && { wait "$fuzz_pid" || rc=1; tail -n 5 "$out/fuzz.log"; }
exit $rc
