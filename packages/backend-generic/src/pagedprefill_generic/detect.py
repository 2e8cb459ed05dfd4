"""Recognising CUDA-compatible parts that have no backend package of their own (this package's
``pagedprefill_detect_device`` hook).

MetaX GPUs present themselves to PyTorch as ``cuda`` devices, so core's general view calls them ``nvidia``,
and NVIDIA-only backends (``sm80``) would claim them. Their device name says ``MetaX``; naming the vendor
here lets those backends refuse them, and the generic backend, which runs on any Triton device, serves them.
A MetaX backend package would recognise them in its own hook instead (this one answers last).
"""

from __future__ import annotations

from typing import Optional

from pagedprefill.device import DeviceInfo


def detect_cuda_compatible(info: DeviceInfo) -> Optional[DeviceInfo]:
    """``info`` with vendor ``metax`` for a MetaX part presented as ``cuda``; None for anything else."""
    if info.type == "cuda" and info.vendor == "nvidia" and "metax" in info.name.lower():
        return info.replace(vendor="metax")
    return None
