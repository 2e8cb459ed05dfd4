"""The ``pagedprefill`` command: ``info``, ``demo``, ``bench`` and ``tune``.

Every error a user can cause (a bad option, a backend that cannot run, a device this torch cannot use) is
one line on standard error that says what to do, with exit status 2; tracebacks are left for bugs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

import torch

from . import __version__
from .api import get_registry, select_backend
from .device import DeviceInfo
from .registry import BackendUnavailableError
from .testing.batches import BatchSpec, fresh_output, make_problem
from .testing.cases import DEFAULT_TOLERANCES
from .validation import dtype_name

DESCRIPTION = ("Prefix-prefill attention over a paged KV cache: show the device and backends (info), run a "
               "checked example (demo), time backends (bench) and tune their tiles (tune).")
EPILOG = ("Core provides info, demo, bench and tune. Run 'pagedprefill COMMAND --help' for the options of a "
          "command.")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line that points to ``--help`` (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a count of runs, a size)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def torch_device(text: str) -> torch.device:
    """argparse type: a torch device that this torch build can use now (``cpu``, ``cuda``, ``cuda:1``...)."""
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a torch device such as cpu, cuda or cuda:1, got {text!r}") \
            from None
    problem = device_problem(device)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return device


def device_problem(device: torch.device) -> Optional[str]:
    """Why this process cannot use ``device`` (and what to do), or None when it can."""
    if device.type == "cuda":
        return _cuda_problem(device)
    if device.type in ("cpu", "meta"):
        return None
    runtime = getattr(torch, device.type, None)
    is_available = getattr(runtime, "is_available", None)
    if callable(is_available) and not is_available():
        return f"{device}: no {device.type} device is available to this torch ({torch.__version__}); use --device cpu"
    return None


def _cuda_problem(device: torch.device) -> Optional[str]:
    # Availability first: vendor builds that expose their GPUs as `cuda` need not set torch.version.cuda.
    if not torch.cuda.is_available():
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return (f"{device}: this torch ({torch.__version__}) is built without CUDA; install a CUDA build of "
                    "torch, or use --device cpu")
        return f"{device}: no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES), or use --device cpu"
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return f"{device}: only {count} CUDA device(s) are visible (cuda:0 to cuda:{count - 1})"
    return None


def _device_info(args) -> DeviceInfo:
    described = getattr(args, "describe", None)
    if described:
        devices = described_devices()
        described = described.lower()
        if described not in devices:
            raise ValueError(f"--describe: expected one of {', '.join(sorted(devices))}, got {described!r}")
        return devices[described]
    return DeviceInfo.detect(args.device)


def described_devices() -> dict[str, DeviceInfo]:
    """Hand-written descriptions of devices that may not be present, for ``info --describe``: a few NVIDIA
    parts known to core, plus whatever installed backends contribute (the bi100 backend adds Iluvatar parts)."""
    def nvidia(name, cap, sms, smem):
        return DeviceInfo(type="cuda", index=0, vendor="nvidia", name=name, capability=cap, warp_size=32,
                          num_sms=sms, max_shared_mem=smem, triton_backend="cuda")

    return {
        "a100": nvidia("NVIDIA A100-SXM4-80GB", (8, 0), 108, 163 * 1024),
        "h200": nvidia("NVIDIA H200", (9, 0), 132, 227 * 1024),
        "v100": nvidia("Tesla V100-SXM2-32GB", (7, 0), 80, 96 * 1024),
        **get_registry().described_devices(),
    }


def cmd_info(args) -> int:
    """Print the device, every backend with its reasons, plugin load errors, and the choice."""
    info = _device_info(args)
    registry = get_registry()
    print(f"pagedprefill {__version__} (torch {torch.__version__})")
    print(f"device: {info.describe()}")
    print("backends (highest priority first):")
    for row in registry.status(info):
        state = "supported" if row.supported else "unsupported"
        prio = "-" if row.priority is None else row.priority
        desc = f" - {row.backend.description}" if row.backend is not None and row.backend.description else ""
        print(f"  {row.name:<12} priority {prio!s:>4}  {state}{desc}")
        for reason in row.reasons:
            print(f"      why not: {reason}")
    try:
        chosen = select_backend(info)
    except BackendUnavailableError as exc:
        print(f"choice: none\n{exc}")
        return 1
    print(f"choice: {chosen.name} (priority {chosen.priority})")
    return 0


def demo_spec(device: torch.device) -> BatchSpec:
    """The demo's batch: Llama-style GQA with ragged prefixes, decode rows and a fresh prompt."""
    if device.type == "cpu":
        return BatchSpec(query_lens=(96, 1, 160, 33), context_lens=(512, 700, 0, 257), num_heads=8,
                         num_kv_heads=2, head_size=128, block_size=16, dtype=torch.float32, seed=7)
    return BatchSpec(query_lens=(1024, 1, 512, 2048, 7), context_lens=(3072, 4000, 0, 1000, 513), num_heads=32,
                     num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16, seed=7)


def cmd_demo(args) -> int:
    """Run a realistic paged batch on the selected backend, check it against an independent float64
    computation, time it."""
    device = args.device or DeviceInfo.detect().torch_device
    info = DeviceInfo.detect(device)
    backend = select_backend(info, args.backend)
    spec = demo_spec(device)
    problem = make_problem(spec, device)
    print(f"device:  {info.describe()}")
    print(f"backend: {backend.name}")
    print(f"batch:   {len(spec.query_lens)} sequences, new tokens {list(spec.query_lens)}, cached "
          f"{list(spec.context_lens)}; q {tuple(problem.q.shape)}, heads {spec.num_heads}/{spec.num_kv_heads}, "
          f"block size {spec.block_size}, {dtype_name(spec.dtype)}")
    from .api import dispatch

    dispatch(problem, backend=backend, validate="full")  # warm-up (compiles kernels), checked below
    times = []
    for _ in range(args.repeats):
        _sync(device)
        t0 = time.perf_counter()
        dispatch(fresh_output(problem), backend=backend)
        _sync(device)
        times.append(time.perf_counter() - t0)
    out = problem.out.double()
    from .testing.sdpa import sdpa_float64

    # Not the reference backend: on a machine without a GPU the demo runs that backend, which would then be
    # compared with itself. PyTorch's own attention in float64 is independent of every backend.
    expected = sdpa_float64(problem)
    err = (out - expected).abs().max().item() if out.numel() else 0.0
    atol, _ = DEFAULT_TOLERANCES[spec.dtype]
    ok = bool(torch.isfinite(out).all()) and err <= atol * 4
    times.sort()
    print(f"max abs error vs float64 torch scaled_dot_product_attention (independent of the backends): "
          f"{err:.3e} (tolerance {atol * 4:.1e}) -> {'OK' if ok else 'MISMATCH'}")
    note = " (Triton's CPU interpreter: a correctness run, not a speed figure)" if (
        device.type == "cpu" and backend.name != "reference") else ""
    print(f"time: median {times[len(times) // 2] * 1e3:.2f} ms over {len(times)} runs (host clock, synchronised)"
          f"{note}")
    return 0 if ok else 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagedprefill", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"pagedprefill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("info", help="show the device, every backend and why it is or is not chosen")
    p.add_argument("--device", type=torch_device, default=None,
                   help="torch device to describe (default: the current GPU, else cpu)")
    p.add_argument("--describe", default=None, metavar="NAME",
                   help=f"describe a device that is not present: {', '.join(sorted(described_devices()))}")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("demo", help="run a realistic batch on the selected backend and check it")
    p.add_argument("--device", type=torch_device, default=None,
                   help="torch device (default: the current GPU, else cpu)")
    p.add_argument("--backend", default=None,
                   help="backend name, as 'pagedprefill info' lists them (default: automatic selection)")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed runs, at least 1 (default: 5)")
    p.set_defaults(func=cmd_demo)
    from . import bench, tune

    bench.register(sub)
    tune.register(sub)
    return parser


#: What a user's mistake raises inside a command (a backend that cannot run, an argument the library
#: refuses); anything else is a bug and keeps its traceback.
USER_ERRORS = (BackendUnavailableError, ValueError, TypeError)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the command line ``argv``; a user's mistake is one line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as exc:
        print(f"pagedprefill {args.command}: error: {error_line(exc, args)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the output went to a reader that stopped early (`pagedprefill info | head`)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the interpreter's final flush does not fail again
        return 1


def error_line(exc: Exception, args: argparse.Namespace) -> str:
    """``exc``'s message on one line, with what to do when the message does not already say it."""
    text = one_line(str(exc))
    if isinstance(exc, BackendUnavailableError) and getattr(args, "backend", None):
        text += ("; leave out --backend to choose automatically ('pagedprefill info' shows which backends can "
                 "run here)")
    return text


def one_line(text: str) -> str:
    """A multi-line message (a list of reasons) joined into one line."""
    parts = [line.strip().removeprefix("- ") for line in text.splitlines() if line.strip()]
    joined = ""
    for part in parts:
        sep = "" if not joined else " " if joined.endswith((":", ".")) else "; "
        joined += sep + part
    return joined


if __name__ == "__main__":
    sys.exit(main())
