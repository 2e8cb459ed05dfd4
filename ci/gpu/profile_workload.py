"""Run one workload of the bench suite a few times through the selected backend, for a profiler to attach to.

Usage: python ci/gpu/profile_workload.py NAME [--layout nhd|split] [--calls N] [--suite default|context|engine]
                                         [--schedule KEY_LOADS=1] [--engine] [--peer fa4|fa4-contig]
``NAME`` is part of a workload's name (the first match is run). The first call compiles; the profiler should
skip it (for example, profile only the last launch). Prints the median time of the calls after the first.

``--engine`` runs the serving engine's form (k = v = None, every key and value in the NHD cache) through the
backend; ``--peer`` runs FlashAttention-4's paged (or contiguous) kernel on that same form instead (core's
``cli.fa4``, when ``flash_attn.cute`` imports), so that a profiler reads both kernels' counters on one problem.
"""

from __future__ import annotations

import argparse
import functools
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
    parser.add_argument("--engine", action="store_true",
                        help="the serving engine's form: k = v = None, every key and value in the NHD cache")
    parser.add_argument("--peer", choices=("fa4", "fa4-contig"), default=None,
                        help="run FlashAttention-4 on the engine's form instead of the backend")
    args = parser.parse_args(argv)
    engine = args.engine or args.peer is not None
    if engine and args.layout != "nhd":
        parser.error("--engine and --peer: the engine's form reads the NHD cache (--layout nhd)")
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
    spec = workload.spec.replace(layout=args.layout, **({"kv_in_cache": True} if engine else {}))
    problem = make_problem(spec, "cuda")
    info = DeviceInfo.detect(torch.device("cuda"))
    if args.peer is not None:
        from pagedprefill.cli import fa4

        module, line = fa4.load()
        if module is None or fa4.unsupported(problem):
            raise SystemExit(f"profile_workload: {line if module is None else fa4.unsupported(problem)}")
        call = (fa4.paged_call if args.peer == "fa4" else fa4.contiguous_call)(module, problem)
        runner, label = call, f"{args.peer} ({line})"
    else:
        backend = get_registry().select(info)
        plan = backend.bind(problem, info)
        runner = functools.partial(plan, problem)
        label = f"{backend.name} ({backend.kernel_for(problem, info)})"
    times = []
    for _ in range(args.calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    median = statistics.median(times[1:] or times)
    form = "engine" if engine else args.layout
    print(f"{workload.name} {form} on {label}: "
          f"{median:.3f} ms, {flops(spec) / median / 1e9:.1f} TFLOP/s over {args.calls} calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
