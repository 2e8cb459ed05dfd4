"""Device-generic torch runtime calls: device guard, synchronisation, memory statistics, for any accelerator.

Each call uses ``torch.accelerator`` where this torch has it and the device is of the current accelerator's
type (torch >= 2.6 for the device calls, later releases for memory statistics), else the device type's own
module (``torch.get_device_module(type)``: ``torch.cuda``, ``torch.xpu``, ``torch.npu``...), which offers
the same calls. The CPU needs none of them: the guard is a no-op, and so is synchronising it.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from .device import current_accelerator_type


def _runtime(device: torch.device, call: str) -> Any:
    """``call`` of ``torch.accelerator`` when it has it for ``device``'s type, else of the type's module."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, call) and current_accelerator_type() == device.type:
        return getattr(accelerator, call)
    return getattr(torch.get_device_module(device.type), call)


def device_guard(device: torch.device) -> ContextManager:
    """Make ``device`` current for its type within the block, so that work is issued to it (no-op on the CPU)."""
    if device.type == "cpu" or device.index is None:
        return contextlib.nullcontext()
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "device_index") and current_accelerator_type() == device.type:
        return accelerator.device_index(device.index)
    return torch.get_device_module(device.type).device(device.index)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type != "cpu":
        _runtime(device, "synchronize")(device)


def memory_allocated(device: torch.device) -> int:
    """Bytes held by tensors on ``device`` now."""
    return int(_runtime(device, "memory_allocated")(device))


def max_memory_allocated(device: torch.device) -> int:
    """Most bytes held by tensors on ``device`` since the last :func:`reset_peak_memory_stats`."""
    return int(_runtime(device, "max_memory_allocated")(device))


def reset_peak_memory_stats(device: torch.device) -> None:
    _runtime(device, "reset_peak_memory_stats")(device)


def empty_cache(device: torch.device) -> None:
    """Give the caching allocator's unused blocks back to the device."""
    if device.type != "cpu":
        _runtime(device, "empty_cache")()
