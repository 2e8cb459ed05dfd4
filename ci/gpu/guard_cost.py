"""What the kernels' memory-safety guards cost: the bench suite timed with each kernel as shipped and with a
copy of it whose guards are taken out, on the same data with the same tiles.

The guards are what keeps inconsistent metadata inside the caller's tensors (docs/reliability.md, "Memory
safety with unvalidated metadata"): block-table columns clamped below at 0; block numbers clamped into the
cache (the Hopper kernel replaces those outside it by block 0); query rows outside ``q`` masked; new-token
keys bounded by one count per sequence, cut at the tensors' end. The clamp of a column to the
table's last one stays in the copies: both kernels read a sequence's pages one tile ahead, also past its last
tile, so valid metadata needs it to stay inside the table. On valid metadata the guards change nothing, which
this script also checks (the two kernels' outputs must be bit-identical). The unguarded copies live only in
this process: their sources are written to a temporary folder and imported from there.

Two kernels are measured: core's portable kernel (on the backend's portable tiles) and, on an sm90 GPU with
backend-sm80 installed, the Hopper kernel (on its own tile, for the calls it takes).

Usage:
    python ci/gpu/guard_cost.py [--backend sm80] [--kernels portable,hopper] [--reps MS] [--rounds N]  # GPU
    TRITON_INTERPRET=1 python ci/gpu/guard_cost.py --smoke      # the portable kernel's mechanics, on the CPU

Prints one line per kernel, workload and layout, then a table: TFLOP/s guarded and unguarded (median over
the rounds of each round's median), and the guards' cost in percent.
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

#: (module, pattern, replacement, at least this many matches): the portable kernel's guards, as written in
#: core's ``triton/blocks.py``, ``triton/masks.py`` and ``triton/kernel.py`` (the Hopper kernel shares
#: ``blocks``' row guard).
GUARDS = [
    ("blocks", r"tl\.maximum\(tl\.minimum\((?P<col>.+?), table_width - 1\), 0\)",
     r"tl.minimum(\g<col>, table_width - 1)", 3),
    ("blocks", r"tl\.minimum\(tl\.maximum\((?P<v>\w+), 0\), last_block\)", r"\g<v>", 3),
    ("blocks", r"\n\s*row_ok = row_ok & \(q_rows >= 0\) & \(q_rows < num_tokens\)", "", 1),
    ("masks", r"in_bounds_len = tl\.maximum\(tl\.minimum\(q_len, in_tensors\), 0\)", "in_bounds_len = q_len", 1),
    ("kernel", r"\n\s*row_ok = row_ok & \(seq_row0 >= 0\)", "", 1),
]
#: The Hopper kernel's own guards, in backend-sm80's ``hopper/loads.py`` (its block-table lookup).
HOPPER_GUARDS = [
    ("loads", r"gl\.maximum\(gl\.minimum\((?P<col>.+?), table_width - 1\), 0\)",
     r"gl.minimum(\g<col>, table_width - 1)", 1),
    ("loads", r"gl\.where\(\(pages >= 0\) & \(pages < num_blocks\), pages, 0\)", "pages", 1),
]
#: The Hopper kernel's modules, copied together into a package of their own (they import each other).
HOPPER_MODULES = ("state", "loads", "epilogue", "consumer", "producer", "kernel")
#: Core's modules with guards, copied without them; the kernels' imports of each are pointed at its copy.
CORE_MODULES = ("blocks", "masks")
BLOCKS_IMPORT = "from pagedprefill.triton.blocks import"


def _strip(sources: dict, guards: list) -> None:
    for module, pattern, replacement, at_least in guards:
        sources[module], count = re.subn(pattern, replacement, sources[module])
        if count < at_least:
            raise SystemExit(f"guard_cost: {module} has {count} matches of {pattern!r}, expected at least "
                             f"{at_least}: the guards moved; update the guard list")


def _import_copy(full_name: str, source: str, where: Path):
    path = where / (full_name.rsplit(".", 1)[1] + ".py")
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(full_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[full_name] = module
    spec.loader.exec_module(module)
    return module


def unguarded_kernels(with_hopper: bool) -> dict:
    """``{"portable": kernel, "hopper": kernel}``: the kernels compiled from copies of their sources without
    :data:`GUARDS` (and :data:`HOPPER_GUARDS`), importing unguarded copies of core's building blocks and masks."""
    import pagedprefill.triton as package

    folder = Path(package.__file__).parent
    sources = {name: (folder / f"{name}.py").read_text() for name in (*CORE_MODULES, "kernel")}
    _strip(sources, GUARDS)
    for name in CORE_MODULES:
        sources["kernel"], count = re.subn(rf"from \.{name} import", f"from ._unguarded_{name} import",
                                           sources["kernel"])
        if count != 1:
            raise SystemExit(f"guard_cost: kernel.py no longer imports core's {name} with 'from .{name} import'")
    where = Path(tempfile.mkdtemp(prefix="pagedprefill-unguarded-"))
    for name in CORE_MODULES:
        _import_copy(f"{package.__name__}._unguarded_{name}", sources[name], where)
    kernels = {"portable": _import_copy(f"{package.__name__}._unguarded_kernel", sources["kernel"],
                                        where).prefix_prefill_kernel}
    if with_hopper:
        kernels["hopper"] = _unguarded_hopper(where)
    return kernels


def _unguarded_hopper(where: Path):
    """The Hopper kernel compiled from a copy of its modules without :data:`HOPPER_GUARDS`, importing the
    unguarded copies of core's modules (the row guard it shares with the portable kernel)."""
    import importlib

    import pagedprefill_sm80.hopper as hopper

    folder = Path(hopper.__file__).parent
    sources = {name: (folder / f"{name}.py").read_text() for name in HOPPER_MODULES}
    _strip(sources, HOPPER_GUARDS)
    if not any(BLOCKS_IMPORT in text for text in sources.values()):
        raise SystemExit(f"guard_cost: the Hopper kernel no longer imports core's blocks with {BLOCKS_IMPORT!r}")
    package = where / "unguarded_hopper"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in sources.items():
        for core in CORE_MODULES:
            text = text.replace(f"from pagedprefill.triton.{core} import",
                                f"from pagedprefill.triton._unguarded_{core} import")
        (package / f"{name}.py").write_text(text)
    sys.path.insert(0, str(where))
    return importlib.import_module("unguarded_hopper.kernel").hopper_prefill_kernel


def _hopper_available(backend, info) -> str:
    """Why the Hopper kernel is not measured here, or "" when it is."""
    if getattr(backend, "name", "") != "sm80":
        return f"the {getattr(backend, 'name', backend)} backend has no Hopper kernel"
    if info.capability != (9, 0):
        return f"the Hopper kernel needs compute capability 9.0, the device has {info.capability}"
    return ""


def _launchers(kernel_name: str, backend, info, problem, shape):
    """``(kernel_call, config)`` for ``kernel_name`` on ``problem``, or ``(None, why not)``."""
    os.environ["PAGEDPREFILL_SM80_KERNEL"] = kernel_name
    config = backend.tile_config(shape, info)
    if kernel_name == "portable":
        from pagedprefill.triton.launch import kernel_call

        return (lambda p: kernel_call(p, config)), config
    from pagedprefill_sm80.hopper.launch import kernel_call, unfit_reason

    if config.kernel != "hopper":
        return None, backend.kernel_choice(shape, info)[1]
    why = unfit_reason(problem, config)
    if why is not None:
        return None, f"the Hopper kernel {why}"
    return (lambda p: kernel_call(p, config, shape)), config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="sm80", help="whose tiles to run (a Triton backend)")
    parser.add_argument("--kernels", default="portable,hopper",
                        help="comma-separated: portable, hopper (the Hopper kernel where the device and backend "
                             "have it)")
    parser.add_argument("--reps", type=int, default=100, help="timing budget per measurement, ms")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of guarded and unguarded")
    parser.add_argument("--smoke", action="store_true",
                        help="one tiny batch on the CPU in Triton's interpreter (portable kernel): the copy, the "
                             "launch and the comparison, no timing")
    args = parser.parse_args(argv)
    wanted = [k for k in args.kernels.split(",") if k]
    unknown = sorted(set(wanted) - {"portable", "hopper"})
    if unknown:
        parser.error(f"--kernels: expected portable and/or hopper, got {', '.join(unknown)}")

    import torch
    from pagedprefill.api import get_registry
    from pagedprefill.backends.triton_base import problem_shape
    from pagedprefill.device import DeviceInfo
    from pagedprefill.triton.kernel import prefix_prefill_kernel
    from pagedprefill.workloads import BatchSpec, default_suite, flops, fresh_output, make_problem

    device = "cpu" if args.smoke else "cuda"
    backend = get_registry().get("generic" if args.smoke else args.backend)
    info = DeviceInfo.detect(torch.device(device))
    if args.smoke:
        wanted = ["portable"]
    if "hopper" in wanted and _hopper_available(backend, info):
        print(f"hopper: not measured: {_hopper_available(backend, info)}", flush=True)
        wanted.remove("hopper")
    unguarded = unguarded_kernels(with_hopper="hopper" in wanted)
    guarded = {"portable": prefix_prefill_kernel}
    if "hopper" in wanted:
        from pagedprefill_sm80.hopper.kernel import hopper_prefill_kernel

        guarded["hopper"] = hopper_prefill_kernel
    if args.smoke:
        runs = [("smoke", BatchSpec(query_lens=(5, 1, 17), context_lens=(9, 0, 33), seed=3))]
    else:
        runs = [(wl.name, wl.spec.replace(layout=layout)) for wl in default_suite() for layout in ("nhd", "split")]
    rows = []
    for name, spec in runs:
        problem = make_problem(spec, device)
        shape = problem_shape(problem)
        for kernel_name in wanted:
            make_call, config = _launchers(kernel_name, backend, info, problem, shape)
            if make_call is None:
                print(f"{kernel_name} | {name} | {spec.layout}: not measured: {config}", flush=True)
                continue
            pair = (guarded[kernel_name], unguarded[kernel_name])
            outputs = []
            for kernel in pair:
                out = fresh_output(problem)
                call = make_call(out)
                kernel[call.grid](*call.args, **call.kwargs)
                outputs.append(out.out)
            same = torch.equal(outputs[0].float().nan_to_num(nan=7.0), outputs[1].float().nan_to_num(nan=7.0))
            if args.smoke:
                rows.append((kernel_name, name, spec.layout, "-", "-", "-", same))
                continue
            import triton.testing

            call = make_call(problem)
            times = {kernel: [] for kernel in pair}
            for _ in range(args.rounds):
                for kernel in pair:
                    times[kernel].append(triton.testing.do_bench(
                        lambda k=kernel, c=call: k[c.grid](*c.args, **c.kwargs), warmup=25, rep=args.reps,
                        return_mode="median"))
            guarded_ms, unguarded_ms = (statistics.median(times[k]) for k in pair)
            f = flops(spec)
            rows.append((kernel_name, name, spec.layout, f"{f / guarded_ms / 1e9:.1f}",
                         f"{f / unguarded_ms / 1e9:.1f}", f"{(guarded_ms / unguarded_ms - 1) * 100:+.1f}%", same))
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
        del problem
        if not args.smoke:
            torch.cuda.empty_cache()
    print("\nkernel | workload | layout | guarded TFLOP/s | unguarded TFLOP/s | cost of the guards | "
          "outputs bit-identical")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    return 0 if rows and all(row[-1] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
