"""The Hopper kernel on an sm90 GPU, in one go: correctness against the reference on a spread of cases, then
its speed against the portable kernel on the bench suite's NHD workloads (same run, same data).

Usage: python ci/gpu/hopper_check.py [--quick] [--reps MS] [--rounds N] [--only NAME,...] [--variants LABEL,...]
                                    [--layouts nhd,split] [--warm N] [--schedule FUSED_SCALE=0]
Each case prints one line; the last lines are a table. Exit status 1 when a case misses the tolerance.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from pagedprefill.api import get_registry
from pagedprefill.device import DeviceInfo
from pagedprefill.testing.cases import DEFAULT_TOLERANCES, assert_matches_reference
from pagedprefill.workloads import BatchSpec, default_suite, flops, fresh_output, make_problem
from pagedprefill_sm80.policy import KERNEL_ENV

BASE = BatchSpec(query_lens=(200, 1, 77, 130), context_lens=(300, 41, 0, 1000), num_heads=32, num_kv_heads=8,
                 head_size=128, block_size=16, dtype=torch.bfloat16, layout="nhd", seed=1)
CASES = {
    "base": {}, "fp16": dict(dtype=torch.float16), "d64": dict(head_size=64), "d256": dict(head_size=256),
    "mha": dict(num_kv_heads=32),
    "mqa": dict(num_kv_heads=1), "bs8": dict(block_size=8), "bs32": dict(block_size=32), "bs64": dict(block_size=64),
    "bs128": dict(block_size=128), "bs256": dict(block_size=256), "window": dict(sliding_window=100),
    "alibi": dict(alibi=True), "softcap": dict(softcap=20.0), "sinks": dict(sinks=True),
    "fp8_out": dict(fp8_out_scale=0.25), "kv_in_cache": dict(kv_in_cache=True),
    "fp8_e4m3": dict(kv_cache_dtype="fp8_e4m3"), "fp8_e5m2_d64": dict(kv_cache_dtype="fp8_e5m2", head_size=64),
    "fp8_fp16": dict(kv_cache_dtype="fp8_e4m3", dtype=torch.float16),
    "d96": dict(head_size=96), "d96_mqa_features": dict(head_size=96, num_kv_heads=1, sliding_window=100, alibi=True,
                                                        sinks=True, fp8_out_scale=0.25),
    "d96_fp8_kv_in_cache": dict(head_size=96, kv_cache_dtype="fp8_e4m3", kv_in_cache=True),
    "fp8_tensor_scales_features": dict(kv_cache_dtype="fp8_e4m3", scale_as_tensor=True, sliding_window=100,
                                       softcap=20.0, kv_in_cache=True),
    "kv_in_cache_noncausal": dict(kv_in_cache=True, causal=False), "non_causal": dict(causal=False),
    "skip_decode": dict(skip_decode=True), "long": dict(query_lens=(1500, 700), context_lens=(2500, 3000)),
    "window_long": dict(query_lens=(1500, 700), context_lens=(2500, 3000), sliding_window=1000),
    "no_prefix": dict(context_lens=(0, 0, 0, 0)),
    "split": dict(layout="split"), "split_d64": dict(layout="split", head_size=64),
    "split_bs64": dict(layout="split", block_size=64), "split_window_alibi": dict(layout="split", sliding_window=100,
                                                                                   alibi=True),
    "split_d256": dict(layout="split", head_size=256),  # 32 keys per step beside three rings
    "split_d96": dict(layout="split", head_size=96),
    "split_d96_mqa_features": dict(layout="split", head_size=96, num_kv_heads=1, sliding_window=100, alibi=True,
                                   sinks=True, fp8_out_scale=0.25),
    "split_d96_kv_in_cache": dict(layout="split", head_size=96, kv_in_cache=True, block_size=32),
    "split_fp8_e4m3": dict(layout="split", kv_cache_dtype="fp8_e4m3"),
    "split_fp8_e5m2_d64_features": dict(layout="split", kv_cache_dtype="fp8_e5m2", head_size=64, scale_as_tensor=True,
                                        sliding_window=100, softcap=20.0, kv_in_cache=True),
    "split_fp8_d96_fp16": dict(layout="split", kv_cache_dtype="fp8_e4m3", head_size=96, dtype=torch.float16),
    "split_fp8_long": dict(layout="split", kv_cache_dtype="fp8_e4m3", query_lens=(1500, 700),
                           context_lens=(2500, 3000)),
    "split_kv_in_cache": dict(layout="split", kv_in_cache=True), "split_long": dict(layout="split",
                                                                                    query_lens=(1500, 700),
                                                                                    context_lens=(2500, 3000)),
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
            exp_rows = ~torch.isnan(expect.out.float())  # decode rows under skip_decode stay unwritten
            err = (problem.out.float() - expect.out.float()).abs()[exp_rows].nan_to_num(nan=float("inf"))
            verdict = "ok"
            try:  # the suites' own comparison: every element, unwritten rows, scaled FP8-output tolerance
                assert_matches_reference(problem.out, problem, *DEFAULT_TOLERANCES[spec.dtype], label=name)
            except AssertionError as exc:
                verdict = "FAIL " + str(exc).splitlines()[0][:160]
            same = torch.equal(problem.out.float().nan_to_num(nan=7.0), again.out.float().nan_to_num(nan=7.0))
            if not same:
                verdict = "FAIL: the plan's launch differs from the first" if verdict == "ok" else verdict
            rows.append((name, kernel, f"{err.max().item():.2e}", same, verdict))
        except Exception as exc:  # report and go on: one run should say everything it can
            rows.append((name, kernel, "-", "-", f"ERROR {type(exc).__name__}: {str(exc)[:200]}"))
        print(" ".join(str(c) for c in rows[-1]), flush=True)
    return rows


#: Variants timed against each other: (label, tile changes, schedule).
#: (Measured before and left out: index order, never faster than heaviest tiles first.)
VARIANTS = [
    ("lockstep", {}, dict(HEAVY_FIRST=True, PINGPONG=False)),
    ("pingpong", {}, dict(HEAVY_FIRST=True, PINGPONG=True)),
    ("pingpong-s4", dict(num_stages=4), dict(HEAVY_FIRST=True, PINGPONG=True)),
    # The split layout's key copies shared by a producer warpgroup.
    ("pingpong-wide-producer", {}, dict(HEAVY_FIRST=True, PINGPONG=True, WIDE_PRODUCER=True)),
    # The split layout's cached keys read by a producer warpgroup with loads and stores instead of 16-byte copies.
    ("pingpong-key-loads", {}, dict(HEAVY_FIRST=True, PINGPONG=True, KEY_LOADS=True)),
    # ... and by 16-byte copies, which the policy keeps where the loads do not win.
    ("pingpong-key-copies", {}, dict(HEAVY_FIRST=True, PINGPONG=True, KEY_LOADS=False, VALUES_FIRST=False)),
    # ... with each tile's value boxes issued before its keys are loaded.
    ("pingpong-key-loads-values-first", {}, dict(HEAVY_FIRST=True, PINGPONG=True, KEY_LOADS=True, VALUES_FIRST=True)),
    # ... with 64 keys per chunk of loads (a whole 128-key tile in flight), on every split row; the policy's
    # choice on 128-key tiles of a 16-bit cache.
    ("pingpong-key-loads-wide-chunks", {},
     dict(HEAVY_FIRST=True, PINGPONG=True, KEY_LOADS=True, VALUES_FIRST=True, WIDE_KEY_CHUNKS=True)),
    # ... with each cached tile's keys loaded before its buffer is free (the policy's key loads otherwise); the
    # policy's choice at head sizes 64-128 (``pingpong`` there), and this variant's at head size 256.
    ("pingpong-early-keys", {}, dict(HEAVY_FIRST=True, PINGPONG=True, EARLY_KEYS=True)),
    # ... and issued once the buffer is free.
    ("pingpong-late-keys", {}, dict(HEAVY_FIRST=True, PINGPONG=True, EARLY_KEYS=False)),
    # FP8 caches in 3 stages: the producer widens each tile once, so the consumers hold no copies of their own.
    ("pingpong-s3", dict(num_stages=3), dict(HEAVY_FIRST=True, PINGPONG=True)),
    # ... through float32: packed conversions instead of one scalar float16-to-bfloat16 conversion per element.
    ("pingpong-f32-widening", {}, dict(HEAVY_FIRST=True, PINGPONG=True, F32_WIDENING=True)),
    # The scale applied to the scores by a multiply of its own before the row maximum (the policy's schedule
    # folds it into each key's exponent as one fused multiply-add).
    ("pingpong-unfused-scale", {}, dict(HEAVY_FIRST=True, PINGPONG=True, FUSED_SCALE=False)),
    # The split layout's cached FP8 keys and values by unswizzled TMA boxes, one per page each (the policy's), and
    # by 16-byte copies.
    ("pingpong-fp8-boxes", {}, dict(HEAVY_FIRST=True, PINGPONG=True, FP8_BOXES=True)),
    ("pingpong-fp8-copies", {}, dict(HEAVY_FIRST=True, PINGPONG=True, FP8_BOXES=False)),
    # The split layout's cached FP8 values widened into the V ring (no V^T ring): on the policy's tile, on the 128
    # keys in 2 stages this makes room for (the policy's for long calls), and 64 keys beside a V^T ring.
    ("pingpong-widen-to-v", {}, dict(HEAVY_FIRST=True, PINGPONG=True, WIDEN_TO_V=True)),
    ("pingpong-widen-to-v-n128", dict(block_n=128, num_stages=2), dict(HEAVY_FIRST=True, PINGPONG=True,
                                                                       WIDEN_TO_V=True)),
    ("pingpong-vt-ring-n64", dict(block_n=64, num_stages=2), dict(HEAVY_FIRST=True, PINGPONG=True,
                                                                  WIDEN_TO_V=False)),
    # 128 keys per step in a 2-deep ring: the policy's tile for NHD and long prefills up to head size 128; timed
    # on the other rows too.
    ("pingpong-n128-s2", dict(block_n=128, num_stages=2), dict(HEAVY_FIRST=True, PINGPONG=True)),
    # 128 keys in a 3-deep ring (225 KiB at head size 128): what `pagedprefill tune` chose for short NHD calls.
    ("pingpong-n128-s3", dict(block_n=128, num_stages=3), dict(HEAVY_FIRST=True, PINGPONG=True)),
    # One query head per tile, with 128 keys in 3 stages: what `pagedprefill tune` once chose for short NHD calls
    # (it ran the bench's many-short row slower than the rule's four heads per tile).
    ("pingpong-g1", dict(heads_per_tile=1), dict(HEAVY_FIRST=True, PINGPONG=True)),
    ("pingpong-n128-s3-g1", dict(block_n=128, num_stages=3, heads_per_tile=1), dict(HEAVY_FIRST=True, PINGPONG=True)),
    # 64 keys in a 3-deep ring up to head size 128, and head size 256 on 64 rows over one consumer warpgroup: the
    # policy's first tiles.
    ("pingpong-n64-s3", dict(block_n=64, num_stages=3), dict(HEAVY_FIRST=True, PINGPONG=True)),
    # 256 keys per step, for head size 64 (the widest warpgroup MMA; 208 KiB in 3 stages on NHD): half the per-step
    # work outside the MMAs of 128 keys again. The split layout's copies of 256 keys need a producer warpgroup.
    # (The split layout's keys by 16-byte copies.)
    ("pingpong-n256-s2", dict(block_n=256, num_stages=2), dict(HEAVY_FIRST=True, PINGPONG=True, KEY_LOADS=False)),
    ("pingpong-n256-s3", dict(block_n=256, num_stages=3), dict(HEAVY_FIRST=True, PINGPONG=True, KEY_LOADS=False)),
    ("pingpong-n256-s2-wide-producer", dict(block_n=256, num_stages=2),
     dict(HEAVY_FIRST=True, PINGPONG=True, WIDE_PRODUCER=True, KEY_LOADS=False)),
    ("pingpong-m64", dict(block_m=64, num_warps=4), dict(HEAVY_FIRST=True, PINGPONG=True)),
]


def largest_error(plan, problem, expect) -> float:
    """The largest absolute difference between ``plan``'s output on ``problem`` and the reference's."""
    check = fresh_output(problem)
    plan(check)
    return (check.out.float() - expect.out.float()).abs().max().item()


def timed_rounds(plans: list, problem, f: float, reps: int, rounds: int) -> list[str]:
    """``"TFLOP/s"`` of each plan on ``problem``: the median over ``rounds`` rounds of each round's median time.
    Each round times every plan once, in the opposite order to the round before, so that a drift of the
    machine's speed during the rounds falls on every plan alike; with several rounds the slowest and fastest
    round follow in brackets."""
    import triton.testing
    from pagedprefill.timing import alternating_rounds

    times = alternating_rounds([lambda p=plan: p(problem) for plan in plans], rounds,
                               lambda fn: triton.testing.do_bench(fn, warmup=25, rep=reps, return_mode="median"))
    out = []
    for ms in times:
        text = f"{f / statistics.median(ms) / 1e9:.1f}"
        if rounds > 1:
            text += f" ({f / max(ms) / 1e9:.0f}-{f / min(ms) / 1e9:.0f})"
        out.append(text)
    return out


def timings(info, backend, reps: int, quick: bool, block_size: int = 0, only: tuple = (),
            rounds: int = 1, variants: list = VARIANTS, layouts: tuple = ("nhd", "split"),
            part: tuple = (0, 1), compile_only: bool = False, head_size: int = 0,
            kv_cache_dtype: str = "") -> list[tuple]:
    """TFLOP/s of the portable kernel and of each Hopper variant on the same data, with each variant's largest
    error against the reference (computed once per workload). ``block_size`` replaces the workloads' own
    (16) when given: the split layout's value pages are TMA boxes one page wide, so the page size sets how wide
    each box and its shared-memory swizzle are; ``head_size`` replaces their head size when given (the suite
    has no short-call rows at head sizes 64 and 96), ``kv_cache_dtype`` their cache's format (it has no short-call
    row with an FP8 cache). ``only``: the workloads whose name contains one of these.
    ``rounds``: alternating rounds per workload (:func:`timed_rounds`). ``variants``: the columns after the
    portable kernel's (each compiles its own kernel per workload). ``layouts``: the cache layouts timed.
    ``part`` = (i, n): only every n-th (workload, layout) pair from the i-th on. ``compile_only``: launch each
    plan once and time nothing (for :func:`warm_compiles`, which fills Triton's cache side by side)."""
    from pagedprefill.backends.triton_base import problem_shape
    from pagedprefill_sm80.hopper.launch import bind_hopper
    from pagedprefill_sm80.hopper.schedule import shared_bytes
    from pagedprefill_sm80.policy import hopper_config, hopper_unfit_reason

    ref = get_registry().get("reference")
    rows = []
    suite = default_suite()[:4] if quick else default_suite()
    if only:
        suite = [wl for wl in suite if any(part in wl.name for part in only)]
        if not suite:
            raise SystemExit(f"hopper_check: --only {','.join(only)} matches no workload of the bench suite")
    pairs = [(wl, layout) for wl in suite for layout in layouts][part[0]::part[1]]
    for wl, layout in pairs:
        spec = wl.spec.replace(layout=layout, **({"block_size": block_size} if block_size else {}),
                               **({"head_size": head_size} if head_size else {}),
                               **({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}))
        problem = make_problem(spec, "cuda")
        if not compile_only:
            expect = fresh_output(problem)
            ref.run(expect, info)
        f = flops(spec)
        shape = problem_shape(problem)
        fits = backend.kernel_for(problem, info)
        # Each column's plan (bound once: the portable one under its own kernel preference), or why there is none.
        columns = []
        os.environ[KERNEL_ENV] = "portable"
        try:
            columns.append(backend.bind(problem, info))
        except Exception as exc:
            columns.append(f"ERROR {type(exc).__name__}: {str(exc)[:120]}")
        os.environ[KERNEL_ENV] = "hopper"
        for _, tile, schedule in variants:
            try:
                if hopper_unfit_reason(shape, info) is not None:
                    raise RuntimeError(hopper_unfit_reason(shape, info))
                config = hopper_config(shape).with_(**tile)
                # The variant's own tile and schedule against the shared-memory model, before Triton says so.
                if shared_bytes(shape, config, schedule) > info.max_shared_mem:
                    raise RuntimeError(f"{shared_bytes(shape, config, schedule) // 1024} KiB of shared memory")
                columns.append(bind_hopper(problem, config, shape, schedule))
            except Exception as exc:
                columns.append(f"- ({type(exc).__name__}: {str(exc)[:60]})")
        if compile_only:
            for plan in columns:
                if callable(plan):
                    plan(problem)
            torch.cuda.synchronize()
            print(f"compiled {wl.name} {layout}", flush=True)
            continue
        errors = {}
        for i, plan in enumerate(columns):
            if callable(plan):
                try:
                    errors[i] = largest_error(plan, problem, expect)
                except Exception as exc:
                    columns[i] = f"- ({type(exc).__name__}: {str(exc)[:60]})"
        runnable = [i for i, plan in enumerate(columns) if callable(plan)]
        speeds = dict(zip(runnable, timed_rounds([columns[i] for i in runnable], problem, f, reps, rounds)))
        result = [f"{wl.name} {layout}"] + [
            f"{speeds[i]} (err {errors[i]:.1e})" if i in speeds else columns[i] for i in range(len(columns))]
        print(" | ".join(result) + f" | policy kernel: {fits}", flush=True)
        rows.append(tuple(result))
        del problem, expect, columns
        torch.cuda.empty_cache()
    return rows


def warm_compiles(argv: list, workers: int) -> None:
    """Compile every kernel the timing needs in ``workers`` processes at once (each a share of the workload and
    layout pairs, launched once): Triton's on-disk cache then hands them to the timing, which would otherwise
    compile them one after another."""
    import subprocess

    started = time.time()
    own, skip = [], False
    for arg in argv:  # everything but --warm N / --warm=N
        if not skip and not arg.startswith("--warm"):
            own.append(arg)
        skip = arg == "--warm"
    procs = [subprocess.Popen([sys.executable, __file__, *own, "--no-correctness", f"--part={i}/{workers}",
                               "--compile-only"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(workers)]
    for i, proc in enumerate(procs):
        out, _ = proc.communicate()
        if proc.returncode != 0:
            print(f"warm part {i}/{workers} exited {proc.returncode}:\n{out[-2000:]}", flush=True)
    print(f"compiled in {workers} processes in {time.time() - started:.0f} s", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="four bench workloads only")
    parser.add_argument("--reps", type=int, default=100, help="do_bench budget per timing, ms")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="time each workload's variants in N alternating rounds and report the median with "
                             "the range (on a shared machine one timing separates only differences of about 10%%)")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--no-correctness", action="store_true",
                        help="time only (the conformance suites already checked these tiles)")
    parser.add_argument("--only", default="", metavar="NAME,...",
                        help="time only the workloads whose name contains one of these (e.g. D64,FP8)")
    parser.add_argument("--variants", default="", metavar="LABEL,...",
                        help="time only these variants (labels of VARIANTS, e.g. pingpong,pingpong-n64-s3)")
    parser.add_argument("--block-size", type=int, default=0, metavar="N",
                        help="time the workloads with cache pages of N tokens instead of their own 16")
    parser.add_argument("--head-size", type=int, default=0, metavar="D",
                        help="time the workloads at head size D instead of their own (e.g. many short at 64)")
    parser.add_argument("--kv-cache-dtype", default="", metavar="FORMAT",
                        help="time the workloads with this cache format instead of their own (e.g. fp8_e4m3)")
    parser.add_argument("--schedule", default="", metavar="NAME=0|1,...",
                        help="check correctness with these schedule flags of the Hopper kernel (e.g. FUSED_SCALE=0)")
    parser.add_argument("--layouts", default="nhd,split", metavar="LAYOUT,...", help="the cache layouts timed")
    parser.add_argument("--warm", type=int, default=0, metavar="N",
                        help="compile the timed kernels in N processes at once before timing")
    parser.add_argument("--part", default="0/1", metavar="I/N", help=argparse.SUPPRESS)
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    layouts = tuple(part for part in args.layouts.split(",") if part)
    if set(layouts) - {"nhd", "split"}:
        parser.error(f"--layouts: expected nhd and/or split, got {args.layouts}")
    part = tuple(int(x) for x in args.part.split("/"))
    wanted = [part for part in args.variants.split(",") if part]
    labels = [v[0] for v in VARIANTS]
    if set(wanted) - set(labels):
        parser.error(f"--variants: unknown {', '.join(sorted(set(wanted) - set(labels)))}; "
                     f"expected labels of {', '.join(labels)}")
    variants = [v for v in VARIANTS if not wanted or v[0] in wanted]
    from pagedprefill_sm80.hopper import schedule

    try:
        schedule.parse(args.schedule)
    except ValueError as exc:
        parser.error(f"--schedule: {exc}")
    # Through the environment: over the policy's flags for each route, as PAGEDPREFILL_SM80_SCHEDULE is.
    if args.schedule:
        earlier = os.environ.get(schedule.SCHEDULE_ENV)
        os.environ[schedule.SCHEDULE_ENV] = ",".join(filter(None, (earlier, args.schedule)))
    os.environ[KERNEL_ENV] = "hopper"
    info = DeviceInfo.detect(torch.device("cuda"))
    backend = get_registry().get("sm80")
    print(info.describe(), "torch", torch.__version__, "schedule", schedule.DEFAULTS, "over which",
          schedule.SCHEDULE_ENV, repr(os.environ.get(schedule.SCHEDULE_ENV, "")), "and the policy's per route",
          flush=True)
    started = time.time()
    rows = [] if args.no_correctness else check(info, backend)
    print(f"\ncorrectness ({time.time() - started:.0f} s): case | kernel | max abs err | "
          f"plan bit-identical | verdict")
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    if args.warm > 1 and not args.no_timing:
        warm_compiles(sys.argv[1:] if argv is None else list(argv), args.warm)
    if args.compile_only:
        only = tuple(p for p in args.only.split(",") if p)
        timings(info, backend, args.reps, args.quick, args.block_size, only, args.rounds, variants, layouts, part,
                compile_only=True, head_size=args.head_size, kv_cache_dtype=args.kv_cache_dtype)
        return 0
    if not args.no_timing:
        print("\nTFLOP/s, same data: workload | portable | " + " | ".join(v[0] for v in variants))
        only = tuple(part for part in args.only.split(",") if part)
        for r in timings(info, backend, args.reps, args.quick, args.block_size, only, args.rounds, variants,
                         layouts, head_size=args.head_size, kv_cache_dtype=args.kv_cache_dtype):
            print("| " + " | ".join(r) + " |")
    return 0 if all(r[-1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
