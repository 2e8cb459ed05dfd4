"""What the portable kernel's memory-safety guards cost: the bench suite timed with the kernel as shipped and
with a copy of it whose guards are taken out, on the same data with the same tiles.

The guards are what keeps inconsistent metadata inside the caller's tensors (docs/reliability.md, "Memory
safety with unvalidated metadata"): block-table columns clamped to the table's width, block numbers outside
the cache replaced by block 0, and query and new-token rows outside ``q``/``k``/``v`` masked. On valid
metadata they change nothing, which this script also checks (the two kernels' outputs must be bit-identical).
The unguarded copy lives only in this process: its source is written to a temporary folder and imported from
there.

Usage:
    python ci/gpu/guard_cost.py [--backend sm80] [--reps MS] [--rounds N]   # on a GPU
    TRITON_INTERPRET=1 python ci/gpu/guard_cost.py --smoke                  # the mechanics, on the CPU

Prints one line per workload and layout, then a table: TFLOP/s guarded and unguarded (median over the
rounds of each round's median), and the guards' cost in percent.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

#: (module, pattern, replacement, at least this many matches): the guards, as written in the kernel's source.
GUARDS = [
    ("blocks", r"tl\.maximum\(tl\.minimum\((?P<col>.+?), table_width - 1\), 0\)", r"\g<col>", 3),
    ("blocks", r"tl\.where\(\((?P<v>\w+) >= 0\) & \((?P=v) < num_blocks\), (?P=v), 0\)", r"\g<v>", 3),
    ("blocks", r"\n\s*row_ok = row_ok & \(q_rows >= 0\) & \(q_rows < num_tokens\)", "", 1),
    ("kernel", r" & \(rows >= 0\) & \(rows < (?:\w+\.)?num_tokens\)", "", 1),
]


def unguarded_kernel():
    """The portable kernel compiled from a copy of its source without :data:`GUARDS`."""
    import pagedprefill.triton as package

    folder = Path(package.__file__).parent
    sources = {name: (folder / f"{name}.py").read_text() for name in ("blocks", "kernel")}
    for module, pattern, replacement, at_least in GUARDS:
        sources[module], count = re.subn(pattern, replacement, sources[module])
        if count < at_least:
            raise SystemExit(f"guard_cost: {module}.py has {count} matches of {pattern!r}, expected at least "
                             f"{at_least}: the guards moved; update GUARDS")
    sources["kernel"], count = re.subn(r"from \.blocks import", "from ._unguarded_blocks import", sources["kernel"])
    if count != 1:
        raise SystemExit("guard_cost: kernel.py no longer imports its building blocks with 'from .blocks import'")
    where = Path(tempfile.mkdtemp(prefix="pagedprefill-unguarded-"))
    modules = {}
    for name in ("blocks", "kernel"):
        path = where / f"_unguarded_{name}.py"
        path.write_text(sources[name])
        full = f"{package.__name__}._unguarded_{name}"
        spec = importlib.util.spec_from_file_location(full, path)
        modules[name] = importlib.util.module_from_spec(spec)
        sys.modules[full] = modules[name]
        spec.loader.exec_module(modules[name])
    return modules["kernel"].prefix_prefill_kernel


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="sm80", help="whose tiles to run (a Triton backend)")
    parser.add_argument("--reps", type=int, default=100, help="timing budget per measurement, ms")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of guarded and unguarded")
    parser.add_argument("--smoke", action="store_true",
                        help="one tiny batch on the CPU in Triton's interpreter: the copy, the launch and the "
                             "comparison, no timing")
    args = parser.parse_args(argv)
    # The guards measured are the portable kernel's: keep a backend from routing to a kernel of its own.
    os.environ["PAGEDPREFILL_SM80_KERNEL"] = "portable"

    import torch
    from pagedprefill.api import get_registry
    from pagedprefill.backends.triton_base import problem_shape
    from pagedprefill.device import DeviceInfo
    from pagedprefill.triton.kernel import prefix_prefill_kernel
    from pagedprefill.triton.launch import kernel_call
    from pagedprefill.workloads import BatchSpec, default_suite, flops, fresh_output, make_problem

    unguarded = unguarded_kernel()
    device = "cpu" if args.smoke else "cuda"
    backend = get_registry().get("generic" if args.smoke else args.backend)
    info = DeviceInfo.detect(torch.device(device))
    if args.smoke:
        runs = [("smoke", BatchSpec(query_lens=(5, 1, 17), context_lens=(9, 0, 33), seed=3))]
    else:
        runs = [(wl.name, wl.spec.replace(layout=layout)) for wl in default_suite() for layout in ("nhd", "split")]
    rows = []
    for name, spec in runs:
        problem = make_problem(spec, device)
        config = backend.tile_config(problem_shape(problem), info)
        outputs = []
        for kernel in (prefix_prefill_kernel, unguarded):
            out = fresh_output(problem)
            call = kernel_call(out, config)
            kernel[call.grid](*call.args, **call.kwargs)
            outputs.append(out.out)
        same = torch.equal(outputs[0].float().nan_to_num(nan=7.0), outputs[1].float().nan_to_num(nan=7.0))
        if args.smoke:
            rows.append((name, spec.layout, "-", "-", "-", same))
            continue
        import triton.testing

        call = kernel_call(problem, config)
        times = {prefix_prefill_kernel: [], unguarded: []}
        for _ in range(args.rounds):
            for kernel in times:
                times[kernel].append(triton.testing.do_bench(
                    lambda k=kernel, c=call: k[c.grid](*c.args, **c.kwargs), warmup=25, rep=args.reps,
                    return_mode="median"))
        guarded_ms, unguarded_ms = (statistics.median(times[k]) for k in (prefix_prefill_kernel, unguarded))
        f = flops(spec)
        rows.append((name, spec.layout, f"{f / guarded_ms / 1e9:.1f}", f"{f / unguarded_ms / 1e9:.1f}",
                     f"{(guarded_ms / unguarded_ms - 1) * 100:+.1f}%", same))
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
        del problem
        torch.cuda.empty_cache()
    print("\nworkload | layout | guarded TFLOP/s | unguarded TFLOP/s | cost of the guards | outputs bit-identical")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    return 0 if all(row[-1] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
