"""The ``generic`` backend: core's Triton kernel with conservative tiles, for any Triton device."""

from __future__ import annotations

from pagedprefill.backends.triton_base import TritonBackend
from pagedprefill.device import DeviceInfo, interpreter_enabled
from pagedprefill.registry import Fallback

from .policy import generic_policy


class GenericBackend(TritonBackend):
    name = "generic"
    priority = 100
    description = "portable Triton kernels (any Triton GPU, or the CPU with TRITON_INTERPRET=1)"
    runs_in_interpreter = True
    policy = staticmethod(generic_policy)

    def supports(self, device: DeviceInfo) -> list[str]:
        """Core's reasons, as :class:`~pagedprefill.registry.Fallback` wherever this backend is meant to run: every
        device but a CPU without ``TRITON_INTERPRET=1`` (where the reference is the intended choice), since it
        needs nothing of a device but a working Triton. Selection then warns that a lower backend runs instead."""
        reasons = super().supports(device)
        if device.type == "cpu" and not interpreter_enabled():
            return reasons
        return [Fallback(reason) for reason in reasons]

    def hardware_reasons(self, device: DeviceInfo) -> list[str]:
        return []
