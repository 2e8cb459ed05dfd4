"""Recognising Example X accelerators: ``xpu`` devices whose runtime name starts with ``Example X``.

Core's general view calls any ``xpu`` device vendor ``xpu``; this names the vendor, and fills the limits the
runtime does not report with the part's documented ones.
"""

from __future__ import annotations

from typing import Optional

from pagedprefill.device import DeviceInfo

from . import VENDOR

DEVICE_TYPE = "xpu"
NAME_PREFIX = "Example X"
#: Shared memory per work-group and sub-group width of every Example X part.
SHARED_MEM = 64 * 1024
WARP_SIZE = 16


def detect_example(info: DeviceInfo) -> Optional[DeviceInfo]:
    """``info`` as an Example X part, or None when the device is not one."""
    if info.type != DEVICE_TYPE or not (info.vendor == VENDOR or info.name.startswith(NAME_PREFIX)):
        return None
    return info.replace(vendor=VENDOR, max_shared_mem=info.max_shared_mem or SHARED_MEM,
                        warp_size=info.warp_size or WARP_SIZE)
