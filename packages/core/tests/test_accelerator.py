"""Device-generic runtime calls (``pagedprefill.accelerator``): torch.accelerator for the current
accelerator's type, the device type's own module for others, nothing for the CPU.

Calls are recorded by replacing them on the torch modules, so which API answers is checked on any machine.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from pagedprefill import accelerator

XPU1 = torch.device("xpu", 1)


@pytest.fixture
def calls(monkeypatch):
    """Record calls of the xpu module and of torch.accelerator: ``[(api, call, args)]``."""
    log = []

    def recorder(api, name, result=None):
        def record(*args):
            log.append((api, name, args))
            return result() if callable(result) else result
        return record

    for api, target in (("xpu", torch.xpu), ("accelerator", torch.accelerator)):
        for name in ("synchronize", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
                     "empty_cache"):
            monkeypatch.setattr(target, name, recorder(api, name, 7 if "memory_allocated" in name else None))
    monkeypatch.setattr(torch.xpu, "device", recorder("xpu", "device", contextlib.nullcontext))
    monkeypatch.setattr(torch.accelerator, "device_index", recorder("accelerator", "device_index",
                                                                    contextlib.nullcontext))
    return log


def test_the_cpu_needs_no_runtime_call(calls):
    cpu = torch.device("cpu")
    with accelerator.device_guard(cpu):
        accelerator.synchronize(cpu)
        accelerator.empty_cache(cpu)
    assert calls == []


def test_a_device_type_that_is_not_the_current_accelerator_uses_its_module(calls, monkeypatch):
    monkeypatch.setattr(accelerator, "current_accelerator_type", lambda: None)
    with accelerator.device_guard(XPU1):
        accelerator.synchronize(XPU1)
    accelerator.reset_peak_memory_stats(XPU1)
    assert accelerator.max_memory_allocated(XPU1) - accelerator.memory_allocated(XPU1) == 0
    accelerator.empty_cache(XPU1)
    assert [(api, name) for api, name, _ in calls] == [
        ("xpu", "device"), ("xpu", "synchronize"), ("xpu", "reset_peak_memory_stats"),
        ("xpu", "max_memory_allocated"), ("xpu", "memory_allocated"), ("xpu", "empty_cache")]
    assert calls[0][2] == (1,) and calls[1][2] == (XPU1,)


def test_the_current_accelerators_type_uses_torch_accelerator(calls, monkeypatch):
    monkeypatch.setattr(accelerator, "current_accelerator_type", lambda: "xpu")
    with accelerator.device_guard(XPU1):
        accelerator.synchronize(XPU1)
    assert accelerator.memory_allocated(XPU1) == 7
    assert [(api, name, args) for api, name, args in calls] == [
        ("accelerator", "device_index", (1,)), ("accelerator", "synchronize", (XPU1,)),
        ("accelerator", "memory_allocated", (XPU1,))]
