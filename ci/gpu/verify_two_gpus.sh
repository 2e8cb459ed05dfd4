#!/usr/bin/env bash
# Two lists of ci/gpu/verify.sh steps at once, one per GPU of a two-GPU machine, each with its own log folder.
# Usage: ci/gpu/verify_two_gpus.sh OUTDIR "STEPS FOR GPU 0" "STEPS FOR GPU 1"
# Environment: GPU0_ENV / GPU1_ENV (e.g. "PAGEDPREFILL_SM80_KERNEL=hopper") apply to one list; STEP_TIMEOUT and
# WORKERS as for verify.sh (WORKERS defaults to half the machine's cores less two, per list).
# Each list's output goes to OUTDIR/gpu0 and OUTDIR/gpu1; their console output to OUTDIR/gpu0.txt, gpu1.txt.
set -u
out=${1:?usage: ci/gpu/verify_two_gpus.sh OUTDIR "STEPS" "STEPS"}
mkdir -p "$out/gpu0" "$out/gpu1"
export WORKERS=${WORKERS:-$(( $(nproc) / 2 > 2 ? $(nproc) / 2 - 2 : 1 ))}
here=$(dirname "$0")
# Installed once here: two installs into one environment at the same time would race.
for p in packages/core packages/backend-*; do
  python3 -m pip install -q --no-deps --no-build-isolation -e "$p" >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
done
export SKIP_INSTALL=1
env CUDA_VISIBLE_DEVICES=0 ${GPU0_ENV:-} bash "$here/verify.sh" "$out/gpu0" $2 >"$out/gpu0.txt" 2>&1 &
first=$!
env CUDA_VISIBLE_DEVICES=1 ${GPU1_ENV:-} bash "$here/verify.sh" "$out/gpu1" $3 >"$out/gpu1.txt" 2>&1 &
second=$!
rc=0
wait $first || rc=1
wait $second || rc=1
exit $rc
