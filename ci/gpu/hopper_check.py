"""The Hopper kernel on an sm90 GPU, in one go: correctness against the reference on a spread of cases, then
its speed against the portable kernel on the bench suite's NHD workloads (same run, same data).

Usage: python ci/gpu/hopper_check.py [--quick] [--reps MS]
Each case prints one line; the last lines are a table. Exit status 1 when a case misses the tolerance.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from pagedprefill.api import get_registry
from pagedprefill.device import DeviceInfo
from pagedprefill.testing.cases import DEFAULT_TOLERANCES
from pagedprefill.workloads import BatchSpec, default_suite, flops, fresh_output, make_problem
from pagedprefill_sm80.policy import KERNEL_ENV

BASE = BatchSpec(query_lens=(200, 1, 77, 130), context_lens=(300, 41, 0, 1000), num_heads=32, num_kv_heads=8,
                 head_size=128, block_size=16, dtype=torch.bfloat16, layout="nhd", seed=1)
CASES = {
    "base": {}, "fp16": dict(dtype=torch.float16), "d64": dict(head_size=64), "mha": dict(num_kv_heads=32),
    "mqa": dict(num_kv_heads=1), "bs8": dict(block_size=8), "bs32": dict(block_size=32), "bs64": dict(block_size=64),
    "bs128": dict(block_size=128), "bs256": dict(block_size=256), "window": dict(sliding_window=100),
    "alibi": dict(alibi=True), "softcap": dict(softcap=20.0), "sinks": dict(sinks=True),
    "fp8_out": dict(fp8_out_scale=0.25), "kv_in_cache": dict(kv_in_cache=True),
    "kv_in_cache_noncausal": dict(kv_in_cache=True, causal=False), "non_causal": dict(causal=False),
    "skip_decode": dict(skip_decode=True), "long": dict(query_lens=(1500, 700), context_lens=(2500, 3000)),
    "window_long": dict(query_lens=(1500, 700), context_lens=(2500, 3000), sliding_window=1000),
    "no_prefix": dict(context_lens=(0, 0, 0, 0)),
}


def check(info, backend) -> list[tuple]:
    rows = []
    ref = get_registry().get("reference")
    for name, changes in CASES.items():
        spec = BASE.replace(**changes)
        problem = make_problem(spec, "cuda")
        kernel = backend.kernel_for(problem, info)
        try:
            plan = backend.bind(problem, info)
            again = fresh_output(problem)
            plan(again)
            torch.cuda.synchronize()
            expect = fresh_output(problem)
            ref.run(expect, info)
            out, exp = problem.out.float(), expect.out.float()
            exp_nan = torch.isnan(exp)
            unwritten = (torch.isnan(out) != exp_nan).sum().item()  # decode rows under skip_decode stay NaN
            atol, rtol = DEFAULT_TOLERANCES[spec.dtype] if spec.fp8_out_scale is None else (0.06, 0.07)
            err = (out - exp).abs()[~exp_nan].nan_to_num(nan=float("inf"))
            bad = (err > atol + rtol * exp.abs()[~exp_nan]).sum().item() + unwritten
            same = torch.equal(problem.out.float().nan_to_num(nan=7.0), again.out.float().nan_to_num(nan=7.0))
            ok = bad == 0 and same
            rows.append((name, kernel, f"{err.max().item():.2e}", bad, same, "ok" if ok else "FAIL"))
        except Exception as exc:  # report and go on: one run should say everything it can
            rows.append((name, kernel, "-", "-", "-", f"ERROR {type(exc).__name__}: {str(exc)[:200]}"))
        print(" ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def timings(info, backend, reps: int, quick: bool) -> list[tuple]:
    import triton.testing

    rows = []
    suite = default_suite()[:4] if quick else default_suite()
    for wl in suite:
        spec = wl.spec.replace(layout="nhd")
        problem = make_problem(spec, "cuda")
        f = flops(spec)
        result = [wl.name]
        for kernel in ("portable", "hopper"):
            os.environ[KERNEL_ENV] = kernel
            ran = backend.kernel_for(problem, info)
            try:
                plan = backend.bind(problem, info)
                ms = triton.testing.do_bench(lambda run=plan, pr=problem: run(pr), warmup=25, rep=reps,
                                             return_mode="median")
                result.append(f"{f / ms / 1e9:.1f} ({ran})")
            except Exception as exc:
                result.append(f"ERROR {type(exc).__name__}: {str(exc)[:120]}")
        print(" | ".join(result), flush=True)
        rows.append(tuple(result))
        del problem
        torch.cuda.empty_cache()
    os.environ[KERNEL_ENV] = "hopper"
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="four bench workloads only")
    parser.add_argument("--reps", type=int, default=100, help="do_bench budget per timing, ms")
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args(argv)
    os.environ[KERNEL_ENV] = "hopper"
    info = DeviceInfo.detect(torch.device("cuda"))
    backend = get_registry().get("sm80")
    print(info.describe(), "torch", torch.__version__, flush=True)
    started = time.time()
    rows = check(info, backend)
    print(f"\ncorrectness ({time.time() - started:.0f} s): case | kernel | max abs err | elements over tol | "
          f"plan bit-identical | verdict")
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    if not args.no_timing:
        print("\nTFLOP/s, NHD, same data: workload | portable | hopper")
        for r in timings(info, backend, args.reps, args.quick):
            print("| " + " | ".join(r) + " |")
    return 0 if all(r[-1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
