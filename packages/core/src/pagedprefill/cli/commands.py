"""The subcommands' arguments and help, declared without torch, Triton or a backend.

The parser is built from these alone, so that ``pagedprefill --help`` and each subcommand's ``--help`` answer
without importing the library; a subcommand's module (:mod:`.info`, :mod:`.demo`, :mod:`.bench`, :mod:`.tune`)
is imported when it runs. What the help and the choices list is written here, and the tests compare it with
the library's own lists (the suites of :data:`pagedprefill.workloads.SUITES`, ``tune``'s dtypes).
"""

from __future__ import annotations

from .arguments import data_device, load_library, positive_int, torch_device

#: The bench suites (:data:`pagedprefill.workloads.SUITES`), sorted.
SUITE_NAMES = ("context", "default", "engine", "models")
#: The query dtypes ``tune`` measures (:data:`pagedprefill.cli.tune.DTYPES`), sorted.
DTYPE_NAMES = ("bf16", "fp16", "fp32")
#: Timed runs by default, and where Triton's CPU interpreter runs the kernels (about 8 s a run on two cores).
REPEATS = 5
INTERPRETER_REPEATS = 1


def run_info(args) -> int:
    """Run ``pagedprefill info`` (:func:`pagedprefill.cli.info.cmd_info`)."""
    from .info import cmd_info

    return cmd_info(args)


def run_demo(args) -> int:
    """Run ``pagedprefill demo`` (:func:`pagedprefill.cli.demo.cmd_demo`)."""
    from .demo import cmd_demo

    return cmd_demo(args)


def run_bench(args) -> int:
    """Run ``pagedprefill bench`` (:func:`pagedprefill.cli.bench.cmd_bench`)."""
    from .bench import cmd_bench

    return cmd_bench(args)


def run_tune(args) -> int:
    """Run ``pagedprefill tune`` (:func:`pagedprefill.cli.tune.cmd_tune`)."""
    from .tune import cmd_tune

    return cmd_tune(args)


def described_device_names() -> str:
    """The names ``info --describe`` takes, sorted and joined: core's and those the installed backends add,
    so the library is imported (and the backends' plugins loaded) when ``info``'s help is shown."""
    load_library()
    from .info import described_devices

    return ", ".join(sorted(described_devices()))


def register_info(sub) -> None:
    """Add the ``info`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("info", help="show the device, every backend and why it is or is not chosen")
    p.add_argument("--device", type=torch_device, default=None,
                   help="torch device to describe (default: the current GPU, else cpu)")
    describe = p.add_argument("--describe", default=None, metavar="NAME",
                              help="describe a device that is not present")
    describe.late_help = lambda: f"describe a device that is not present: {described_device_names()}"
    p.add_argument("--suite", choices=["default", "engine", "models"], default="default",
                   help="the bench suite whose tiles, head packing and kernels to show on a GPU (default: "
                        "%(default)s)")
    p.set_defaults(func=run_info)


def register_demo(sub) -> None:
    """Add the ``demo`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("demo", help="run a realistic batch on the selected backend and check it")
    p.add_argument("--device", type=data_device, default=None,
                   help="torch device (default: the current GPU, else cpu)")
    p.add_argument("--backend", default=None,
                   help="backend name, as 'pagedprefill info' lists them (default: automatic selection)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help=f"timed runs, at least 1 (default: {REPEATS}; {INTERPRETER_REPEATS} where Triton's CPU "
                        "interpreter runs the kernels, each run taking seconds)")
    p.set_defaults(func=run_demo)


def register_bench(sub) -> None:
    """Add the ``bench`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("bench", help="time the workload suite for backends and peers (GPU)")
    p.add_argument("--backend", action="append", help="backend to time (repeatable; default: the selected one)")
    p.add_argument("--device", type=data_device, default=None, help="CUDA device to time on (default: the current)")
    p.add_argument("--suite", choices=SUITE_NAMES, default="default",
                   help="workloads to time: the performance table's (default); context scaling, 2 x 1024 new "
                        "tokens on 8k, 32k and 128k cached (context); or a serving engine's batches, each timed "
                        "as the engine calls it (k = v = None, every key and value in the NHD cache) and the "
                        "classic way, with FlashAttention-4 beside them when flash_attn.cute imports (engine); "
                        "or, timed the same way, one GPU's share of the heads of common models at tensor-parallel "
                        "degrees 1-8, each as a prefix-cached, a chunked and a decode row (models)")
    p.add_argument("--only", action="append", help="run workloads whose name contains this (repeatable)")
    p.add_argument("--list", action="store_true",
                   help="list the suite's workloads (shapes, TFLOP, K/V bytes) and exit; needs no device")
    p.add_argument("--reps", type=positive_int, default=200, help="do_bench repetition budget in ms (default 200)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="engine and models suites: alternating rounds in which every column of a workload is "
                        "timed, the median reported (default %(default)s)")
    p.add_argument("--layout", choices=["split", "nhd", "both"], default="both",
                   help="cache layout(s) the backends read (default: %(default)s)")
    p.add_argument("--no-reference", action="store_true", help="skip timing the reference implementation")
    p.add_argument("--no-host-overhead", action="store_true", help="skip the host-overhead row")
    p.add_argument("--json", default="bench.json", help="write rows here (default bench.json)")
    p.add_argument("--png", default="bench.png", help="write a chart here (default bench.png)")
    p.add_argument("--commit", default=None, help="commit id to record with the results")
    p.set_defaults(func=run_bench)


def register_tune(sub) -> None:
    """Add the ``tune`` subcommand to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("tune", help="sweep a backend's tile configs on this GPU and write its policy table")
    p.add_argument("--backend", default="sm80",
                   help="backend whose declared search space is swept; its search_space() must offer tiles "
                        "(default: %(default)s)")
    p.add_argument("--device", type=data_device, default=None,
                   help="CUDA device to tune on (default: the current one)")
    p.add_argument("--head-size", type=positive_int, nargs="+", default=[64, 128],
                   help="head sizes to tune (default: 64 128)")
    p.add_argument("--dtype", nargs="+", choices=DTYPE_NAMES, default=["bf16"],
                   help="query dtypes to tune (default: bf16)")
    p.add_argument("--workload", nargs="+", choices=["short", "long"], default=["long", "short"],
                   help="workload shapes to tune (default: long short)")
    p.add_argument("--layout", nargs="+", choices=["nhd", "split"], default=["nhd"],
                   help="cache layouts to tune; each is its own table key (default: nhd)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="alternating rounds in which every candidate is timed; the median round counts (default: 3)")
    p.add_argument("--out", default=None, help="table path (default: the user table the policy reads)")
    p.set_defaults(func=run_tune)
