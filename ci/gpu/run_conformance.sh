#!/usr/bin/env bash
# On a GPU machine with no package index: install nox from carried wheels (if any) and the project's
# packages without dependencies, then run the hardware nox sessions with --no-venv.
# Usage: ci/gpu/run_conformance.sh OUTDIR [session...]
set -u
out=${1:-/tmp/pagedprefill-gpu}; shift || true
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
for p in packages/core packages/backend-*; do
  python3 -m pip install -q --no-deps --no-build-isolation -e "$p" >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
done
python3 -m pagedprefill info | tee "$out/info.txt"
rc=0
for s in "${@:-generic sm80}"; do
  for session in $s; do
    echo "=== nox -s $session"
    python3 -m nox --no-venv -s "$session" -- ${PYTEST_EXTRA:-} 2>&1 | tee "$out/nox-$session.log" | tail -n 25
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
done
exit $rc
