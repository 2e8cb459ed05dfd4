"""Codegen report: what the kernel compiles to for every policy tile of the bench suite, without a GPU.

For each described device (H200 = sm90, A100 = sm80), each workload of ``pagedprefill bench``'s suite and
each cache layout, the backend that would be selected picks its tile; the kernel is compiled ahead of time
for that target and the report shows registers, spills, shared memory, whether the dots are ``wgmma``,
the count of asynchronous copies, and whether the key loops are software-pipelined.

On the H200 the sm80 policy runs its Hopper kernel where it takes the call and measured faster: those rows
show its tile, TMA copies, warp specialisation and ``setmaxnreg``. ``--hopper`` compiles the H200 rows a second
time with the Hopper kernel forced (``PAGEDPREFILL_SM80_KERNEL=hopper``: also the calls the policy keeps on the
portable kernel), ``--portable`` with core's portable kernel forced (what other GPUs run).

Usage::

    python ci/codegen_report.py                 # the whole suite, both devices, both layouts
    python ci/codegen_report.py --quick         # one workload per device and layout (CI)
    python ci/codegen_report.py --hopper        # also the H200 rows on the Hopper kernel, forced
    python ci/codegen_report.py --portable      # also the H200 rows on the portable kernel, forced
    python ci/codegen_report.py --json out.json

Exit status 1 when a tile spills registers or a key loop is not pipelined on sm80+ (``--strict``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pagedprefill.api import select_backend
from pagedprefill.backends.triton_base import spec_shape
from pagedprefill.cli.info import described_devices
from pagedprefill.triton.codegen import summarize
from pagedprefill.workloads import default_suite, make_problem

DEVICES = {"h200": 90, "a100": 80}


def small_twin(spec):
    """The same kind of batch with short lengths: the code depends on shapes and flags, not on lengths."""
    n = len(spec.query_lens)
    return spec.replace(query_lens=(33,) * min(n, 2), context_lens=(70,) * min(n, 2))


def report(quick: bool = False, devices=DEVICES, layouts=("split", "nhd"), log=print,
           forced: tuple[str, ...] = ()) -> list[dict]:
    """One row per (device, workload, layout); each kernel named in ``forced`` (``hopper``, ``portable``) adds
    the H200 rows with sm80's choice forced to it (their ``forced`` field names it)."""
    rows = _report(quick, devices, layouts, log)
    for kernel in forced if "h200" in devices else ():
        previous = os.environ.get(KERNEL_ENV)
        os.environ[KERNEL_ENV] = kernel
        try:
            rows += [{**row, "forced": kernel} for row in _report(quick, {"h200": devices["h200"]}, layouts, log)]
        finally:
            if previous is None:
                os.environ.pop(KERNEL_ENV, None)
            else:
                os.environ[KERNEL_ENV] = previous
    return rows


#: The sm80 backend's kernel choice (see pagedprefill_sm80.policy).
KERNEL_ENV = "PAGEDPREFILL_SM80_KERNEL"


def _report(quick: bool, devices, layouts, log) -> list[dict]:
    suite = default_suite()[:1] if quick else default_suite()
    described = described_devices()
    rows = []
    for device_name, capability in devices.items():
        device = described[device_name]
        backend = select_backend(device)
        for workload in suite:
            for layout in layouts:
                spec = workload.spec.replace(layout=layout)
                shape = spec_shape(spec, small_twin(spec))
                config = backend.tile_config(shape, device)
                started = time.perf_counter()
                row = {"device": device_name, "backend": backend.name, "workload": workload.name,
                       "layout": layout, "tile": config.to_dict()}
                try:
                    twin = make_problem(small_twin(spec))
                    summary = summarize(backend.compile_for_target(twin, config, capability), capability)
                except Exception as exc:  # the target cannot compile this kernel (an FP8 format it lacks, say)
                    row["error"] = str(exc).strip().splitlines()[-1][:160]
                else:
                    row.update(summary.to_dict())
                row["compile_s"] = round(time.perf_counter() - started, 1)
                rows.append(row)
                log(format_row(row))
    return rows


HEADER = (f"{'device':<6} {'workload':<30} {'layout':<6} {'kernel':<8} {'tile':<22} {'regs':>4} {'spill':>5} "
          f"{'smem KiB':>8} {'dots':<8} {'cp.async':>8} {'TMA':>4} {'pipelined':>9} {'sync loads':>10} {'ws':>3} "
          f"{'setmaxnreg':>10}")


def format_row(r: dict) -> str:
    t = r["tile"]
    tile = f"{t['block_m']}x{t['block_n']} w{t['num_warps']} s{t['num_stages']} g{t['heads_per_tile']}"
    head = f"{r['device']:<6} {r['workload'][:30]:<30} {r['layout']:<6} {t.get('kernel', 'portable'):<8} {tile:<22}"
    if "error" in r:
        return f"{head} does not compile: {r['error']}"
    return (f"{head} {r['registers'] or '?':>4} "
            f"{r['spill_bytes'] if r['spill_bytes'] is not None else '?':>5} {r['shared_bytes'] / 1024:>8.1f} "
            f"{r['dots']:<8} {r['async_copies']:>8} {r['tma_copies']:>4} {r['pipelined_waits']:>9} "
            f"{r['unpipelined_loads']:>10} {'yes' if r['warp_specialized'] else 'no':>3} {r['setmaxnreg']:>10}")


def problems(rows: list[dict]) -> list[str]:
    """Rows that point at slow code: spills, or key loops left without asynchronous loads."""
    out = []
    for r in rows:
        where = f"{r['device']} {r['workload']} {r['layout']}"
        if "error" in r:
            out.append(f"{where}: does not compile for this target: {r['error']}")
            continue
        if r["spill_bytes"]:
            out.append(f"{where}: {r['spill_bytes']} bytes of register spills")
        if r["unpipelined_loads"]:
            out.append(f"{where}: {r['unpipelined_loads']} K/V tile load(s) in key loops not pipelined")
        if r.get("wgmma_hazards"):
            out.append(f"{where}: {r['wgmma_hazards']} instruction(s) touch registers an in-flight warpgroup MMA "
                       f"owns (undefined results)")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one workload per device and layout")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--strict", action="store_true", help="exit 1 on spills or unpipelined key loops")
    parser.add_argument("--hopper", action="store_true", help="also the H200 rows with sm80's Hopper kernel forced")
    parser.add_argument("--portable", action="store_true",
                        help="also the H200 rows with core's portable kernel forced (what other GPUs run)")
    args = parser.parse_args(argv)
    print(HEADER, flush=True)
    forced = tuple(kernel for kernel, wanted in (("hopper", args.hopper), ("portable", args.portable)) if wanted)
    rows = report(quick=args.quick, log=lambda line: print(line, flush=True), forced=forced)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    found = problems(rows)
    for line in found:
        print("warning:", line)
    return 1 if (args.strict and found) else 0


if __name__ == "__main__":
    sys.exit(main())
