"""Recognising Iluvatar CoreX GPUs (the ``pagedprefill_detect_device`` hook of this package).

Iluvatar's build of PyTorch presents the GPU as a ``cuda`` device with NVIDIA-like capabilities (a BI-V100
reports 7.0, like an NVIDIA V100), so core's general view calls it ``nvidia``. It is recognised here, first
signal wins:

1. ``PAGEDPREFILL_VENDOR=iluvatar`` (core has already set ``info.vendor``);
2. a device name starting with ``Iluvatar``;
3. a CoreX build of torch: ``+corex`` in ``torch.__version__``, or a ``torch.corex`` module.

The limits the runtime did not report (shared memory, warp size) come from ``devices.json``.
"""

from __future__ import annotations

from typing import Optional

import torch
from pagedprefill.device import DeviceInfo

from .device_table import device_limits

VENDOR = "iluvatar"


def is_iluvatar(info: DeviceInfo) -> bool:
    """Whether ``info`` (core's general view of a device) is an Iluvatar CoreX GPU."""
    if info.type != "cuda":
        return False
    if info.vendor == VENDOR:
        return True
    return info.name.lower().startswith("iluvatar") or "+corex" in torch.__version__ or hasattr(torch, "corex")


def detect_iluvatar(info: DeviceInfo) -> Optional[DeviceInfo]:
    """``info`` as an Iluvatar part, with the table's limits where the runtime reported none; else None."""
    if not is_iluvatar(info):
        return None
    limits = device_limits(info)
    return info.replace(vendor=VENDOR, max_shared_mem=limits.max_shared_mem, warp_size=limits.warp_size)
