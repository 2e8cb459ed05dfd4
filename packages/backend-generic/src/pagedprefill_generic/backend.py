"""The ``generic`` backend: core's Triton kernel with conservative tiles, for any Triton device."""

from __future__ import annotations

from pagedprefill.backends.triton_base import TritonBackend
from pagedprefill.device import DeviceInfo

from .policy import generic_policy


class GenericBackend(TritonBackend):
    name = "generic"
    priority = 100
    description = "portable Triton kernels (any Triton GPU, or the CPU with TRITON_INTERPRET=1)"
    runs_in_interpreter = True
    policy = staticmethod(generic_policy)

    def hardware_reasons(self, device: DeviceInfo) -> list[str]:
        return []
