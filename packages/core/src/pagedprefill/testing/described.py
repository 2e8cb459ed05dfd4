"""Describe a device that is not present to torch and to Triton, so that detection runs as on a machine
that has it: for testing a backend's ``pagedprefill_detect_device`` hook and selection without hardware.

::

    from pagedprefill.testing.described import described_device

    with described_device("xpu", name="Contoso X1", triton_backend="xpu", max_shared_mem=64 * 1024):
        info = pagedprefill.DeviceInfo.detect("xpu:0")     # through every installed plugin's hook

Inside the block, ``torch.get_device_module(type)`` reports one available device (``is_available``,
``device_count``) whose ``get_device_properties`` answers with the description,
and (when ``triton_backend`` is given) Triton's active driver serves the device type with that target.
The process registry is reset on entry and exit, so no detection is answered from before or kept after.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Iterator, Optional

import torch

#: Fields of torch's device properties, as the ``cuda`` module names them, that core's detection reads.
TORCH_FIELDS = ("major", "minor", "multi_processor_count", "warp_size", "shared_memory_per_block_optin")


class DescribedDriver:
    """Stands in for Triton's active driver on a machine whose Triton serves ``device_type`` devices."""

    def __init__(self, device_type: str, backend: str, properties: Optional[dict] = None) -> None:
        self.device_type, self.backend = device_type, backend
        props = dict(properties or {})
        self.utils = SimpleNamespace(get_device_properties=lambda index: dict(props))

    def get_active_torch_device(self) -> torch.device:
        return torch.device(self.device_type, 0)

    def get_current_target(self) -> SimpleNamespace:
        return SimpleNamespace(backend=self.backend, arch="described", warp_size=32)


@contextlib.contextmanager
def described_device(device_type: str, *, name: str, triton_backend: Optional[str] = None,
                     max_shared_mem: int = 0, num_sms: int = 0, warp_size: int = 0,
                     capability: tuple[int, int] = (0, 0)) -> Iterator[None]:
    """Within the block, torch (and Triton, if ``triton_backend`` is set) report a ``device_type`` device.

    Limits left at 0 are not reported, as when a runtime does not know them. torch reports the name,
    capability and SM count; Triton's driver reports shared memory and warp size (as Triton does), or
    torch does when there is no ``triton_backend``.
    """
    from .. import reset_registry

    props = SimpleNamespace(name=name, major=capability[0], minor=capability[1], multi_processor_count=num_sms,
                            warp_size=0 if triton_backend else warp_size,
                            shared_memory_per_block_optin=0 if triton_backend else max_shared_mem)
    module = torch.get_device_module(device_type)
    replaced = {"get_device_properties": lambda device=None: props, "is_available": lambda: True,
                "device_count": lambda: 1}
    saved = {attr: module.__dict__.get(attr) for attr in replaced}
    for attr, fn in replaced.items():
        setattr(module, attr, fn)
    driver = previous = None
    if triton_backend is not None:
        from triton.runtime import driver

        # the driver as it was, without making Triton look for one (which fails on a machine without GPU)
        previous = getattr(driver, "_active", None)
        driver.set_active(DescribedDriver(device_type, triton_backend,
                                          {"max_shared_mem": max_shared_mem, "warpSize": warp_size}))
    reset_registry()
    try:
        yield
    finally:
        for attr, fn in saved.items():
            if fn is None:
                delattr(module, attr)
            else:
                setattr(module, attr, fn)
        if driver is not None:
            driver.set_active(previous)
        reset_registry()
