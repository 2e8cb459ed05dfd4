"""The FP8 query on an sm90 GPU, in one go: its error against a float64 oracle per context length, then its speed
on the Hopper kernel's routes beside the 16-bit and FP8-cache rows (same run, alternating rounds).

Rows (Llama-3-8B shapes, 32 / 8 heads; ``engine``: every key and value in the cache, k = v = None):

* ``bf16``: a bfloat16 query on a bfloat16 cache;
* ``fp8 cache``: a bfloat16 query on an e4m3 cache (the producer widens every tile);
* ``fp8 q widened``: an e4m3 query, widened as it is loaded, on an e4m3 cache;
* ``fp8 q scores``: the same under ``FP8_SCORES`` (``Q K^T`` on FP8 MMAs; the policy's route).

Usage: python ci/gpu/fp8_check.py [--reps MS] [--rounds N] [--layouts nhd,split] [--json PATH] [--no-accuracy]
        [--no-timing]
Each row prints one line; exit status 1 when an error exceeds the FP8 query's accuracy target (3e-2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from pagedprefill.device import DeviceInfo
from pagedprefill.testing.sdpa import sdpa_float64
from pagedprefill.tiling import problem_shape
from pagedprefill.timing import alternating_rounds
from pagedprefill.workloads import LLAMA3_8B, BatchSpec, flops, make_problem
from pagedprefill_sm80.hopper.launch import bind_hopper
from pagedprefill_sm80.hopper.schedule import shape_unfit_reason, shared_bytes
from pagedprefill_sm80.policy import hopper_config

#: Relative L2 error against the float64 oracle an FP8 query may reach, at every context length.
ACCURACY_TARGET = 3e-2

BASE = BatchSpec(**LLAMA3_8B, spare_blocks=0, kv_in_cache=True)
#: (label, changes to the batch, schedule flags, tile changes)
VARIANTS = [
    ("bf16", {}, {}, {}),
    ("fp8 cache", dict(kv_cache_dtype="fp8_e4m3"), {}, {}),
    ("fp8 q widened", dict(kv_cache_dtype="fp8_e4m3", fp8_query=True), dict(FP8_SCORES=False), {}),
    ("fp8 q scores", dict(kv_cache_dtype="fp8_e4m3", fp8_query=True), dict(FP8_SCORES=True), {}),
]
#: name -> (changes to the batch, the layouts it is timed on)
WORKLOADS = {
    "prefix-cached 8x(1024+7168)": (dict(query_lens=(1024,) * 8, context_lens=(7168,) * 8), ("nhd", "split")),
    "prefix-cached block 128": (dict(query_lens=(1024,) * 8, context_lens=(7168,) * 8, block_size=128), ("nhd",)),
    "long prefill 2x8192": (dict(query_lens=(8192,) * 2, context_lens=(0, 0)), ("nhd",)),
    "D64 32/32 prefix-cached": (dict(query_lens=(1024,) * 8, context_lens=(7168,) * 8, head_size=64,
                                     num_kv_heads=32), ("nhd",)),
}
#: Layout -> the context lengths its accuracy is measured at (256 new tokens on each).
ACCURACY_CONTEXTS = {"nhd": (1024, 32768, 131072), "split": (1024, 32768)}


def plan_for(spec: BatchSpec, schedule: dict, tile: dict, info: DeviceInfo):
    """``(problem, plan)`` of ``spec`` on the Hopper kernel with ``schedule`` and the policy's tile changed by
    ``tile``, or ``(problem, why not)``."""
    problem = make_problem(spec, "cuda")
    shape = problem_shape(problem)
    config = hopper_config(shape).with_(**tile)
    unfit = shape_unfit_reason(shape, config)
    if unfit is None and shared_bytes(shape, config, schedule) > info.max_shared_mem:
        unfit = f"{shared_bytes(shape, config, schedule) // 1024} KiB of shared memory"
    if unfit is not None:
        return problem, f"- ({unfit[:60]})"
    return problem, bind_hopper(problem, config, shape, schedule)


def relative_l2(out: torch.Tensor, expect: torch.Tensor) -> float:
    diff = (out.double() - expect).norm()
    return (diff / expect.norm()).item()


def accuracy(info: DeviceInfo) -> tuple[list[dict], bool]:
    """Relative L2 error of each variant against the float64 oracle (one oracle per batch: the variants that
    differ only in their schedule share it), 256 new tokens on each cached length."""
    rows, ok = [], True
    for layout, contexts in ACCURACY_CONTEXTS.items():
        for ctx in contexts:
            oracles = {}
            for label, changes, schedule, tile in VARIANTS:
                if tile:
                    continue  # the same arithmetic as its two-stage twin
                spec = BASE.replace(query_lens=(256,), context_lens=(ctx,), layout=layout, **changes)
                problem, plan = plan_for(spec, schedule, tile, info)
                if not callable(plan):
                    rows.append(dict(layout=layout, context=ctx, variant=label, error=None, note=plan))
                    continue
                plan(problem)
                if spec not in oracles:
                    oracles[spec] = sdpa_float64(problem)
                error = relative_l2(problem.out, oracles[spec])
                ok = ok and not (spec.fp8_query and error > ACCURACY_TARGET)
                rows.append(dict(layout=layout, context=ctx, variant=label, error=error))
                print(f"accuracy {layout} ctx {ctx} {label}: relative L2 {error:.3e}", flush=True)
            del oracles
            torch.cuda.empty_cache()
    return rows, ok


def timing(info: DeviceInfo, reps: int, rounds: int, layouts: list[str]) -> list[dict]:
    """TFLOP/s of every variant on every workload, medians over alternating rounds."""
    import triton.testing

    rows = []
    for name, (changes, timed_layouts) in WORKLOADS.items():
        for layout in (layout for layout in timed_layouts if layout in layouts):
            plans, labels, problems = [], [], []
            for label, variant, schedule, tile in VARIANTS:
                spec = BASE.replace(layout=layout, **changes, **variant)
                if spec.head_size > 128 and spec.kv_cache_dtype != "auto":
                    continue
                problem, plan = plan_for(spec, schedule, tile, info)
                if not callable(plan):
                    print(f"{name} {layout} {label}: {plan}", flush=True)
                    continue
                plans.append(plan)
                labels.append(label)
                problems.append(problem)
            f = flops(BASE.replace(**changes))
            times = alternating_rounds([lambda p=plan, q=problem: p(q) for plan, problem in zip(plans, problems)],
                                       rounds, lambda fn: triton.testing.do_bench(fn, warmup=25, rep=reps,
                                                                                   return_mode="median"))
            row = dict(workload=name, layout=layout)
            for label, ms in zip(labels, times):
                row[label] = f / statistics.median(ms) / 1e9
                row[label + " range"] = [f / max(ms) / 1e9, f / min(ms) / 1e9]
            rows.append(row)
            print(f"{name} {layout}: " + " | ".join(f"{label} {row[label]:.1f} ({row[label + ' range'][0]:.0f}-"
                                                   f"{row[label + ' range'][1]:.0f})" for label in labels), flush=True)
            del plans, problems
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=100, help="do_bench budget per timing, ms")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per workload")
    parser.add_argument("--layouts", default="nhd,split")
    parser.add_argument("--no-accuracy", action="store_true")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    info = DeviceInfo.detect(torch.device("cuda"))
    layouts = args.layouts.split(",")
    result, ok = {}, True
    if not args.no_accuracy:
        result["accuracy"], ok = accuracy(info)
    if not args.no_timing:
        result["timing"] = timing(info, args.reps, args.rounds, layouts)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
