"""The ``sm80`` backend: core's Triton kernel with measured tiles for NVIDIA sm80+."""

from __future__ import annotations

from pagedprefill.backends.triton_base import TritonBackend
from pagedprefill.device import DeviceInfo
from pagedprefill.tiling import ProblemShape, TileConfig

from .policy import search_space, sm80_policy

MIN_CAPABILITY = (8, 0)


class Sm80Backend(TritonBackend):
    name = "sm80"
    priority = 200
    description = "Triton kernels tuned for NVIDIA sm80+ (A100, L40, H100/H200, B200)"
    policy = staticmethod(sm80_policy)

    def hardware_reasons(self, device: DeviceInfo) -> list[str]:
        reasons = []
        if device.vendor != "nvidia":
            reasons.append(f"needs an NVIDIA GPU, the device's vendor is {device.vendor!r} "
                           f"(capability {device.capability[0]}.{device.capability[1]} alone does not tell)")
        elif device.capability < MIN_CAPABILITY:
            reasons.append(f"needs compute capability >= 8.0, the device has "
                           f"{device.capability[0]}.{device.capability[1]}")
        if device.triton_backend not in (None, "cuda"):
            reasons.append(f"needs Triton's 'cuda' target, the device reports {device.triton_backend!r}")
        return reasons

    def search_space(self, shape: ProblemShape, device: DeviceInfo) -> list[TileConfig]:
        """Candidates ``pagedprefill tune`` measures for ``shape`` on ``device``."""
        return search_space(shape, device)
