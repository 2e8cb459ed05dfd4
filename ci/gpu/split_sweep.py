"""Split keys against one walk on launches too small to fill the GPU (GPU, alternating rounds).

Each row is a few decode or speculative sequences in the serving engine's form (k = v = None, every key and
value in the NHD cache, the block table as wide as its longest sequence needs), bound by the sm80 backend once
per split count: 1 (one walk per tile), the policy's choice, and the counts of ``--splits``. Every plan's output is
checked against the float32 reference before it is timed; the times are medians of ``do_bench`` medians over
alternating rounds. What it answers: from how many key tiles on does a split pay for its combine
(:data:`pagedprefill.tiling.UNSPLIT_WALK_TILES`).

``--kernels`` also reads each plan's kernels off the profiler (``torch.profiler``, one call at a time, the GPU idle
between calls): the GPU time of the attention kernel and of the combine, and the span from the first kernel's
start to the last one's end, medians over ``--kernel-calls`` calls. Those figures hold no host time, which the
event timings can: a call's events enclose the host's launch of its second kernel.

Usage: python ci/gpu/split_sweep.py [--contexts 128,256,512,1024,2048,4096] [--splits 2,4,8] [--rounds 5]
       [--tokens 1,8] [--kernels]
One line per row: microseconds per call of each split count, and the policy's count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton.testing
from pagedprefill.api import get_registry
from pagedprefill.cli.bench import output_error, reference_output
from pagedprefill.device import DeviceInfo
from pagedprefill.plans import forget
from pagedprefill.tiling import problem_shape
from pagedprefill.timing import alternating_rounds
from pagedprefill.workloads import LLAMA3_8B, BatchSpec, fresh_output, make_problem


def plan_with_splits(backend, problem, info, splits):
    """The backend's plan for ``problem`` with the policy's tile and ``splits`` (None: the policy's count)."""
    policy_tile = backend.tile_config
    if splits is not None:
        backend.tile_config = lambda shape, device: policy_tile(shape, device).with_(key_splits=splits)
    try:
        return backend.bind(problem, info)
    finally:
        backend.tile_config = policy_tile
        forget()


def kernel_times(plan, problem, calls: int) -> dict:
    """Medians over ``calls`` calls of ``plan``, each alone on an idle GPU, of its kernels' GPU time as the
    profiler records it: ``kernels_us`` (one figure per kernel, in launch order) and ``span_us`` (first start to
    last end)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            plan(problem)
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.end > e.time_range.start), key=lambda e: e.time_range.start)
    per_call = len(kernels) // calls if calls else 0
    if per_call == 0 or len(kernels) % calls:
        return dict(kernels_us=[], span_us=float("nan"), names=[e.name for e in kernels[:4]])
    calls_kernels = [kernels[i * per_call:(i + 1) * per_call] for i in range(calls)]
    durations = [statistics.median(c[k].time_range.end - c[k].time_range.start for c in calls_kernels)
                 for k in range(per_call)]
    span = statistics.median(c[-1].time_range.end - c[0].time_range.start for c in calls_kernels)
    return dict(kernels_us=durations, span_us=span, names=[e.name[:40] for e in calls_kernels[0]])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="128,256,512,768,1024,2048,4096", help="cached keys per sequence")
    parser.add_argument("--splits", default="2,4,8", help="split counts timed beside 1 and the policy's")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=50, help="do_bench budget per timing, ms")
    parser.add_argument("--tokens", default="1,8", help="new tokens per sequence: 1 (4 decode rows), 8 (2 "
                        "speculative rows of 8), as a list")
    parser.add_argument("--kernels", action="store_true", help="also each plan's kernel times off the profiler")
    parser.add_argument("--kernel-calls", type=int, default=30)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    shapes = [{1: (4, 1), 8: (2, 8)}[int(t)] for t in args.tokens.split(",") if t]
    counts = sorted({1, *(int(s) for s in args.splits.split(",") if s)})
    info = DeviceInfo.detect(torch.device("cuda"))
    backend = get_registry().get("sm80")
    results, ok = [], True
    for seqs, tokens in shapes:
        for ctx in contexts:
            spec = BatchSpec(**LLAMA3_8B, query_lens=(tokens,) * seqs, context_lens=(ctx,) * seqs, spare_blocks=0,
                             layout="nhd", kv_in_cache=True, seed=ctx)
            problem = make_problem(spec, "cuda")
            policy = backend.tile_config(problem_shape(problem), info)
            expect = reference_output(problem)
            labels = [*map(str, counts), f"policy ({policy.key_splits})"]
            plans = [plan_with_splits(backend, problem, info, n) for n in counts]
            plans.append(plan_with_splits(backend, problem, info, None))
            for label, plan in zip(labels, plans):
                check = fresh_output(problem)
                plan(check)
                error = output_error(check.out, expect)
                if not error["within_tolerance"]:
                    ok = False
                    print(f"FAIL {seqs} x {tokens} on {ctx}, {label} splits: {error}", flush=True)
            times = alternating_rounds([lambda p=plan, q=problem: p(q) for plan in plans], args.rounds,
                                       lambda fn: triton.testing.do_bench(fn, warmup=10, rep=args.reps,
                                                                          return_mode="median"))
            us = [statistics.median(t) * 1e3 for t in times]
            tiles = -(-(ctx + tokens) // policy.block_n)
            cells = " | ".join(f"{label} {t:6.1f}" for label, t in zip(labels, us))
            print(f"{seqs} x {tokens} tokens on {ctx:>5} keys ({tiles} tiles of {policy.block_n}): {cells} us",
                  flush=True)
            row = dict(seqs=seqs, tokens=tokens, context=ctx, key_tiles=tiles, policy_splits=policy.key_splits,
                       us=dict(zip(labels, us)))
            if args.kernels:
                row["profiled"] = {label: kernel_times(plan, problem, args.kernel_calls)
                                   for label, plan in zip(labels, plans)}
                cells = " | ".join(f"{label} " + "+".join(f"{k:.1f}" for k in t["kernels_us"])
                                   + f" (span {t['span_us']:.1f})" for label, t in row["profiled"].items())
                print(f"    GPU kernels, us: {cells}", flush=True)
            results.append(row)
            del plans, problem, expect
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=info.name, rows=results), fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
