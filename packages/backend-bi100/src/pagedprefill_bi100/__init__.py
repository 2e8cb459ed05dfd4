"""pagedprefill-bi100: the backend for Iluvatar CoreX GPUs (BI-V100, BI-V150, BI-V150S, MR-V50).

:func:`described_devices` gives hand-built :class:`pagedprefill.DeviceInfo` values of the known parts, for
tests and for showing what the policy would pick on hardware that is not present.
"""

from __future__ import annotations

from typing import Optional

from pagedprefill.device import DeviceInfo

from .backend import Bi100Backend
from .device_table import DeviceLimits, described_device, device_limits, load_device_table
from .policy import bi100_policy

__all__ = ["Bi100Backend", "DeviceLimits", "bi100_policy", "described_device", "described_devices",
           "device_limits"]


def described_devices(triton_backend: Optional[str] = "cuda") -> dict[str, DeviceInfo]:
    """``{model: DeviceInfo}`` of every known part (``"BI-V100"``, ``"BI-V150"``, ...) with the table's limits.

    ``triton_backend`` is what Triton would report on that machine: ``"cuda"`` on builds that present the
    GPU as a CUDA target, ``"corex"`` on builds with their own backend name.
    """
    _, parts, _ = load_device_table()
    return {model: described_device(model, triton_backend) for model in parts}
