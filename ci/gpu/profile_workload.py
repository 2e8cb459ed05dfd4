"""Run one workload of the bench suite a few times through the selected backend, for a profiler to attach to.

Usage: python ci/gpu/profile_workload.py NAME [--layout nhd|split] [--calls N] [--suite default|context]
                                         [--schedule KEY_LOADS=1]
``NAME`` is part of a workload's name (the first match is run). The first call compiles; the profiler should
skip it (for example, profile only the last launch). Prints the median time of the calls after the first.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from pagedprefill.api import get_registry
from pagedprefill.device import DeviceInfo
from pagedprefill.workloads import SUITES, flops, make_problem


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name")
    parser.add_argument("--layout", choices=("nhd", "split"), default="nhd")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--suite", choices=sorted(SUITES), default="default")
    parser.add_argument("--schedule", default="", help="sm80's Hopper kernel's schedule flags, NAME=0|1,...")
    args = parser.parse_args(argv)
    if args.schedule:
        import os

        from pagedprefill_sm80.hopper import launch

        launch.parse_schedule(args.schedule)  # a bad flag fails here, naming it
        # Through the environment: over the policy's flags for the route, under nothing else.
        os.environ[launch.SCHEDULE_ENV] = args.schedule
    matches = [wl for wl in SUITES[args.suite]() if args.name in wl.name]
    if not matches:
        raise SystemExit(f"profile_workload: no workload of the {args.suite} suite has {args.name!r} in its name")
    workload = matches[0]
    spec = workload.spec.replace(layout=args.layout)
    problem = make_problem(spec, "cuda")
    info = DeviceInfo.detect(torch.device("cuda"))
    backend = get_registry().select(info)
    plan = backend.bind(problem, info)
    times = []
    for _ in range(args.calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        plan(problem)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    median = statistics.median(times[1:] or times)
    print(f"{workload.name} {args.layout} on {backend.name} ({backend.kernel_for(problem, info)}): "
          f"{median:.3f} ms, {flops(spec) / median / 1e9:.1f} TFLOP/s over {args.calls} calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
