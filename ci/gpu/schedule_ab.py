"""The Hopper kernel's schedule against a variant of it, on a bench suite's rows (GPU, alternating rounds).

Each row is built once in the serving engine's form (k = v = None, every key and value in the NHD cache) and,
with ``--forms``, in the classic form on the split layout (or NHD); each form is bound twice by the sm80 backend
as a caller would get it (the policy's tile, split keys and flags): once as the policy resolves it, once with the
flags of ``--flags`` over them (``PAGEDPREFILL_SM80_SCHEDULE`` at bind time). Both plans' outputs are checked
against the float32 reference before they are timed; the times are medians of ``do_bench`` medians over
alternating rounds.

Usage: python ci/gpu/schedule_ab.py --flags IDLE_HALF=0 [--suite engine|models|default|context]
       [--only mixed --only decode ...] [--forms engine,split]
       [--rounds 5] [--reps 100] [--json PATH]
One line per row and form: TFLOP/s (GB/s too for memory-bound rows) of each plan and their ratio; `--json`
is written after every row, so that a run cut short keeps what it timed. Exit status 1
when a plan misses the conformance tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton.testing
from pagedprefill.api import get_registry
from pagedprefill.cli.bench import output_error, reference_output
from pagedprefill.device import DeviceInfo
from pagedprefill.timing import alternating_rounds
from pagedprefill.workloads import SUITES, classic_twin, flops, fresh_output, kv_bytes, make_problem
from pagedprefill_sm80.hopper.schedule import SCHEDULE_ENV, parse


def bound(backend, problem, info, flags: str):
    """The backend's plan for ``problem`` with ``flags`` (``""``: the policy's) over the route's schedule."""
    previous = os.environ.pop(SCHEDULE_ENV, None)
    if flags:
        os.environ[SCHEDULE_ENV] = flags
    try:
        return backend.bind(problem, info)
    finally:
        os.environ.pop(SCHEDULE_ENV, None)
        if previous is not None:
            os.environ[SCHEDULE_ENV] = previous


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flags", required=True, help="the variant's schedule flags, e.g. IDLE_HALF=0")
    parser.add_argument("--suite", choices=sorted(SUITES), default="engine", help="the suite whose rows are timed")
    parser.add_argument("--only", action="append", default=[], help="rows whose name contains this (repeatable)")
    parser.add_argument("--forms", default="engine,split", help="engine, nhd and/or split")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=100, help="do_bench budget per timing, ms")
    parser.add_argument("--json", default="")
    parser.add_argument("--compile-only", action="store_true",
                        help="bind and launch each plan once, check and time nothing (to fill Triton's cache from "
                             "several processes at once before the timing run)")
    args = parser.parse_args(argv)
    parse(args.flags)  # a malformed flag is an error before any GPU work
    forms = [form for form in args.forms.split(",") if form]
    if set(forms) - {"engine", "nhd", "split"}:
        parser.error(f"--forms: expected engine, nhd and/or split, got {args.forms}")
    rows = [wl for wl in SUITES[args.suite]() if not args.only or any(part in wl.name for part in args.only)]
    if not rows:
        parser.error(f"--only {args.only}: no row of the {args.suite} suite matches")
    info = DeviceInfo.detect(torch.device("cuda"))
    backend = get_registry().get("sm80")
    results, ok = [], True
    for wl in rows:
        engine = make_problem(wl.spec.replace(layout="nhd", kv_in_cache=True), "cuda")
        if args.compile_only:
            for form in forms:
                problem = fresh_output(engine) if form == "engine" else classic_twin(engine, form)
                for flags in ("", args.flags):
                    bound(backend, problem, info, flags)(problem)
            torch.cuda.synchronize()
            print(f"compiled {wl.name}", flush=True)
            continue
        expect = reference_output(engine)
        f, nbytes = flops(wl.spec), kv_bytes(wl.spec)
        for form in forms:
            problem = fresh_output(engine) if form == "engine" else classic_twin(engine, form)
            plans = [bound(backend, problem, info, ""), bound(backend, problem, info, args.flags)]
            errors = []
            for plan in plans:
                check = fresh_output(problem)
                plan(check)
                error = output_error(check.out, expect)
                if not error["within_tolerance"]:
                    ok = False
                    print(f"FAIL {wl.name} {form}: {error}", flush=True)
                errors.append(error.get("max_abs_err", float("nan")))
            times = alternating_rounds([lambda p=plan, q=problem: p(q) for plan in plans], args.rounds,
                                       lambda fn: triton.testing.do_bench(fn, warmup=25, rep=args.reps,
                                                                          return_mode="median"))
            ms = [statistics.median(t) for t in times]
            row = dict(workload=wl.name, form=form, policy_ms=ms[0], variant_ms=ms[1], errors=errors,
                       policy_tflops=f / ms[0] / 1e9, variant_tflops=f / ms[1] / 1e9,
                       rounds_ms=times)
            text = (f"{wl.name} {form}: policy {row['policy_tflops']:.1f} | {args.flags} "
                    f"{row['variant_tflops']:.1f} TFLOP/s")
            if wl.memory_bound:
                row["policy_gbs"], row["variant_gbs"] = nbytes / ms[0] / 1e6, nbytes / ms[1] / 1e6
                text += f" ({row['policy_gbs']:.0f} | {row['variant_gbs']:.0f} GB/s)"
            print(f"{text} | policy / variant {ms[1] / ms[0]:.3f} x | err {errors[0]:.1e} {errors[1]:.1e}",
                  flush=True)
            results.append(row)
            if args.json:  # after every row: a run cut short keeps what it timed
                with open(args.json, "w") as fh:
                    json.dump(dict(flags=args.flags, rows=results), fh, indent=1)
            del plans
        del engine, expect
        torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
