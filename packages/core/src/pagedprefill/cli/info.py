"""``pagedprefill info``: the device, every backend with its reasons, and the choice."""

from __future__ import annotations

import torch

from .. import __version__
from ..api import get_registry, select_backend
from ..device import DeviceInfo
from ..registry import BackendUnavailableError


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
    registry.check_environment()  # a bad value is the one error line, before any output
    print(f"pagedprefill {__version__} (torch {torch.__version__})")
    print(f"device: {info.describe()}")
    settings = [f"{declared.name}={declared.value()}" for _, declared in registry.environment_variables()
                if declared.value()]
    if settings:
        print(f"environment: {', '.join(dict.fromkeys(settings))}")
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
    if info.type != "cpu":
        _print_routes(chosen, info, args.suite)
    return 0


def packing(config, shape) -> str:
    """How a tile holds the query heads of a KV group, in words: ``"3 heads x 42 tokens"`` and, when a group
    takes several tiles, how many (``"2 heads x 64 tokens, 2 tiles per group"``)."""
    heads = config.heads_per_tile
    tokens = config.tokens_per_tile
    text = f"{heads} head{'s' if heads > 1 else ''} x {tokens} token{'s' if tokens > 1 else ''}"
    chunks = -(-shape.group_size // heads)
    return text + (f", {chunks} tiles per group" if chunks > 1 else "")


def _print_routes(backend, info: DeviceInfo, suite: str = "default") -> None:
    """The tile, head packing and kernel the chosen backend's policy picks for each workload of a bench suite:
    both cache layouts for the default suite, the engine's call (k = v = None, NHD) for the engine and models
    suites."""
    from ..backends.triton_base import spec_shape
    from ..workloads import SUITES
    from .bench import ENGINE_FORM_SUITES

    engine_form = suite in ENGINE_FORM_SUITES
    print(f"{backend.name}'s tiles and kernels for the {suite} suite (pagedprefill bench --suite {suite}):")
    for workload in SUITES[suite]():
        for layout in (("nhd",) if engine_form else ("split", "nhd")):
            spec = workload.spec.replace(layout=layout, kv_in_cache=engine_form)
            twin = spec.replace(query_lens=(3,) * len(spec.query_lens), context_lens=(5,) * len(spec.query_lens))
            shape = spec_shape(spec, twin)
            kernel, why = backend.kernel_choice(shape, info)
            config = backend.tile_config(shape, info)
            tile = "" if config is None else (f" {config.block_m}x{config.block_n} w{config.num_warps} "
                                              f"s{config.num_stages} [{packing(config, shape)}]")
            form = "engine" if engine_form else layout
            print(f"  {workload.name[:60]:<60} {form:<6} {kernel}{tile}" + (f" ({why})" if why else ""))
