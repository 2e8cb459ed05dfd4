"""The ``pagedprefill`` command: ``info``, ``demo``, ``bench`` and ``tune``."""

from __future__ import annotations

import argparse
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


def _device_info(args) -> DeviceInfo:
    described = getattr(args, "describe", None)
    if described:
        devices = described_devices()
        described = described.lower()
        if described not in devices:
            raise SystemExit(f"--describe: expected one of {sorted(devices)}, got {described!r}")
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
    """Run a realistic paged batch on the selected backend, check it against the reference, time it."""
    device = torch.device(args.device) if args.device else DeviceInfo.detect().torch_device
    info = DeviceInfo.detect(device)
    backend = select_backend(info, args.backend)
    spec = demo_spec(device)
    problem = make_problem(spec, device)
    print(f"device:  {info.describe()}")
    print(f"backend: {backend.name}")
    print(f"batch:   {len(spec.query_lens)} sequences, new tokens {list(spec.query_lens)}, cached "
          f"{list(spec.context_lens)}; q {tuple(problem.q.shape)}, heads {spec.num_heads}/{spec.num_kv_heads}, "
          f"block size {spec.block_size}, {str(spec.dtype).replace('torch.', '')}")
    from .api import dispatch

    dispatch(problem, backend=backend, validate="full")  # warm-up (compiles kernels), checked below
    times = []
    for _ in range(args.repeats):
        _sync(device)
        t0 = time.perf_counter()
        dispatch(fresh_output(problem), backend=backend)
        _sync(device)
        times.append(time.perf_counter() - t0)
    out = problem.out.float()
    from .reference import reference_prefill

    ref = reference_prefill(fresh_output(problem)).float()
    err = (out - ref).abs().max().item() if out.numel() else 0.0
    atol, _ = DEFAULT_TOLERANCES[spec.dtype]
    ok = bool(torch.isfinite(out).all()) and err <= atol * 4
    times.sort()
    print(f"max abs error vs reference: {err:.3e} (tolerance {atol * 4:.1e}) -> {'OK' if ok else 'MISMATCH'}")
    note = " (Triton's CPU interpreter: a correctness run, not a speed figure)" if (
        device.type == "cpu" and backend.name != "reference") else ""
    print(f"time: median {times[len(times) // 2] * 1e3:.2f} ms over {len(times)} runs (host clock, synchronised)"
          f"{note}")
    return 0 if ok else 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedprefill", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pagedprefill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="show the device, every backend and why it is or is not chosen")
    p.add_argument("--device", default=None, help="torch device to describe (default: current)")
    p.add_argument("--describe", default=None, metavar="NAME",
                   help=f"describe a device that is not present: {', '.join(sorted(described_devices()))}")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("demo", help="run a realistic batch on the selected backend and check it")
    p.add_argument("--device", default=None, help="torch device (default: current)")
    p.add_argument("--backend", default=None, help="backend name (default: automatic selection)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs (default 5)")
    p.set_defaults(func=cmd_demo)
    from . import bench, tune

    bench.register(sub)
    tune.register(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
