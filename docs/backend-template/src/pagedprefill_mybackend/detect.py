"""Recognising this backend's hardware: the ``pagedprefill_detect_device`` hook's work.

Core describes every device from what torch and Triton report in general: an ``xpu`` device gets vendor
``xpu``, a ``cuda`` device ``nvidia`` (or ``amd`` on ROCm builds of torch), with the name, capability, SM
count and Triton target the runtime reports, and 0 for limits nobody reported. Here the backend says which
of those devices are its own, names their vendor (the name :meth:`MyBackend.supports` checks), and fills in
limits the runtime does not report.

Replace :data:`DEVICE_TYPE` and :data:`NAME_PREFIX` with what ``pagedprefill info --device <type>:0`` shows
for your hardware. As shipped, no device is named like this, so the hook never answers.
"""

from __future__ import annotations

from typing import Optional

from pagedprefill.device import DeviceInfo

#: The vendor this backend is for (placeholder: no device reports it).
VENDOR = "myvendor"

#: The torch device type of the hardware (``"cuda"`` for parts that present themselves as CUDA devices).
DEVICE_TYPE = "xpu"

#: How the runtime names the parts (placeholder).
NAME_PREFIX = "My Accelerator"

#: Shared memory per block of every part, for runtimes that do not report it (bytes).
SHARED_MEM = 64 * 1024


def detect_mine(info: DeviceInfo) -> Optional[DeviceInfo]:
    """``info`` described as this backend's hardware, or None when the device is not one of its parts.

    ``info.vendor`` already equals :data:`VENDOR` when the user set ``PAGEDPREFILL_VENDOR`` to it, for a
    part whose name is not recognised.
    """
    if info.type != DEVICE_TYPE:
        return None
    if info.vendor != VENDOR and not info.name.startswith(NAME_PREFIX):
        return None
    return info.replace(vendor=VENDOR, max_shared_mem=info.max_shared_mem or SHARED_MEM)
