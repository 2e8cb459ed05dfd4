"""The ``example`` backend: core's Triton kernel with this package's policy, on Example X accelerators."""

from __future__ import annotations

from pagedprefill.backends.triton_base import TritonBackend
from pagedprefill.device import DeviceInfo

from . import VENDOR
from .policy import example_policy


class ExampleBackend(TritonBackend):
    name = "example"
    priority = 200
    description = "Example X accelerators (xpu): Triton kernels with tiles for 64 KiB work-groups"
    policy = staticmethod(example_policy)

    def supports(self, device: DeviceInfo) -> list[str]:
        if device.vendor != VENDOR:
            return [f"example runs on {VENDOR} devices only, not on vendor {device.vendor!r} ({device.name})"]
        return super().supports(device)  # Triton installed and serving the device
