"""Time a sweep of TileConfigs of the shared kernel on the bench workloads (GPU), with peers, in one run.

Usage: ``python ci/gpu/tile_sweep.py [--out DIR] [--only NAME ...]``. Every config is first checked against
the reference on the workload's own data (a wrong config is reported, never timed); times are medians of
``triton.testing.do_bench``; the first call of each config is timed separately as its compile time. Prints
one table at the end and writes ``sweep.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton.testing
from pagedprefill.cli.bench import sdpa_peers
from pagedprefill.testing import DEFAULT_TOLERANCES, assert_matches_reference, fresh_output, make_problem
from pagedprefill.tiling import TileConfig
from pagedprefill.triton.launch import launch_prefill
from pagedprefill.workloads import default_suite, flops


def T(m, n, w, s, g=1, pagewise=False):
    return TileConfig(block_m=m, block_n=n, num_warps=w, num_stages=s, heads_per_tile=g, pagewise=pagewise)


def P(m, n, w, s, g=1):
    """A page-wise tile."""
    return T(m, n, w, s, g, pagewise=True)


SWEEP = {
    # workload name prefix -> (layouts, configs)
    "prefix-cached": (("nhd", "split"), [P(128, 64, 8, 3), P(128, 64, 8, 3, 2), P(128, 64, 8, 3, 4),
                                         P(128, 32, 4, 3), P(128, 64, 8, 4)]),
    "long prefill": (("nhd",), [T(128, 64, 8, 3), T(128, 64, 8, 3, 2)]),
    "chunked": (("nhd", "split"), [P(128, 64, 8, 3), P(128, 64, 8, 3, 2)]),
    "many short": (("nhd", "split"), [P(128, 64, 8, 3, 4), P(64, 64, 4, 3, 4)]),
    "D64": (("nhd",), [P(128, 64, 4, 3), P(128, 64, 8, 3), P(128, 64, 4, 3, 2)]),
    "D96": (("nhd",), [P(128, 64, 8, 3), P(128, 64, 8, 3, 2)]),
    "D256": (("nhd",), [P(128, 64, 8, 2), P(128, 32, 8, 3)]),
    "fp16": (("nhd",), [P(128, 64, 8, 3)]),
    "FP8": (("nhd", "split"), [P(128, 128, 8, 2), P(128, 64, 8, 3), P(128, 64, 8, 3, 2)]),
    "window": (("nhd",), [P(128, 64, 8, 3)]),
}


def cfg_name(c: TileConfig) -> str:
    return f"{c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages} g{c.heads_per_tile}{' pw' if c.pagewise else ''}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", action="append")
    ap.add_argument("--rep", type=int, default=100, help="do_bench budget per timing (ms)")
    args = ap.parse_args()
    rows = []
    for wl in default_suite():
        match = [k for k in SWEEP if wl.name.startswith(k)]
        if not match or (args.only and not any(o in wl.name for o in args.only)):
            continue
        layouts, configs = SWEEP[match[0]]
        f = flops(wl.spec)
        for layout in layouts:
            problem = make_problem(wl.spec.replace(layout=layout), "cuda")
            if layout == layouts[0]:
                for label, fn in sdpa_peers(problem).items():
                    fn()
                    ms = triton.testing.do_bench(fn, warmup=10, rep=args.rep, return_mode="median")
                    rows.append(dict(workload=wl.name, layout="contig", impl=label, ms=ms, tflops=f / ms / 1e9))
                    print(f"{wl.name:<30} {'contig':<6} {label:<24} {ms:8.3f} ms {f / ms / 1e9:7.1f}", flush=True)
            for cfg in configs:
                row = dict(workload=wl.name, layout=layout, impl=cfg_name(cfg), config=cfg.to_dict())
                try:
                    check = fresh_output(problem)
                    t0 = time.perf_counter()
                    launch_prefill(check, cfg)
                    torch.cuda.synchronize()
                    row["first_call_s"] = time.perf_counter() - t0
                    atol, rtol = DEFAULT_TOLERANCES[wl.spec.dtype]
                    assert_matches_reference(check.out, check, atol, rtol, label=cfg_name(cfg))
                    ms = triton.testing.do_bench(lambda c=cfg, pr=problem: launch_prefill(pr, c), warmup=10,
                                                 rep=args.rep, return_mode="median")
                    row.update(ms=ms, tflops=f / ms / 1e9)
                except Exception as exc:  # resources exceeded or wrong result: report, keep going
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                rows.append(row)
                print(f"{wl.name:<30} {layout:<6} {row['impl']:<24} "
                      + (f"{row['ms']:8.3f} ms {row['tflops']:7.1f}  first {row['first_call_s']:.1f}s"
                         if "ms" in row else row["error"]), flush=True)
            del problem
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "sweep.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print("\n| workload | layout | impl | TFLOP/s |\n| --- | --- | --- | ---: |")
    for r in rows:
        print(f"| {r['workload']} | {r['layout']} | {r['impl']} | {r.get('tflops', float('nan')):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
