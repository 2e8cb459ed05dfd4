"""What a device is: vendor, name, capability, warp size, SM count, shared memory, Triton backend.

:class:`DeviceInfo` is a frozen value. ``DeviceInfo.detect()`` reads it from the runtime (once per device,
cached); tests and tools build one by hand to describe hardware that is not present.

Vendor detection for devices PyTorch calls ``cuda`` (NVIDIA, Iluvatar CoreX and MetaX all do), first match
wins:

1. ``PAGEDPREFILL_VENDOR`` environment variable (an explicit override);
2. ``torch.version.hip`` set: ``amd``;
3. device name starting with ``Iluvatar``, ``+corex`` in ``torch.__version__``, or a ``torch.corex``
   module: ``iluvatar``;
4. device name containing ``MetaX``: ``metax``;
5. otherwise ``nvidia``.

Capability alone never decides the vendor: an NVIDIA V100 and an Iluvatar BI-V100 both report (7, 0).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

DeviceLike = Union[str, int, torch.device, None]

#: Shared memory per block when the runtime cannot tell, by vendor (bytes).
DEFAULT_SHARED_MEM = {"nvidia": 48 * 1024, "iluvatar": 48 * 1024, "amd": 64 * 1024, "metax": 64 * 1024}


@dataclass(frozen=True)
class DeviceInfo:
    """A description of one device, detected or written by hand.

    Attributes:
        type: torch device type (``"cuda"``, ``"cpu"``, ``"xpu"``...).
        index: device index, or None for the CPU.
        vendor: ``nvidia``, ``iluvatar``, ``amd``, ``metax``, ``cpu`` or another lower-case name.
        name: the runtime's device name (e.g. ``"NVIDIA H200"``, ``"Iluvatar BI-V100"``).
        capability: ``(major, minor)`` as reported (Iluvatar reports NVIDIA-like numbers).
        warp_size: threads per warp (64 on Iluvatar and AMD CDNA).
        num_sms: streaming multiprocessors / compute units.
        max_shared_mem: shared memory available to one block, in bytes (opt-in maximum).
        triton_backend: Triton's target backend (``"cuda"``, ``"hip"``, ``"corex"``, ``"interpreter"``), or
            None when Triton is not installed or has no driver for this device.
    """

    type: str
    vendor: str
    name: str
    index: Optional[int] = None
    capability: tuple[int, int] = (0, 0)
    warp_size: int = 32
    num_sms: int = 1
    max_shared_mem: int = 0
    triton_backend: Optional[str] = None

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type, self.index) if self.index is not None else torch.device(self.type)

    def describe(self) -> str:
        """One line for humans, as ``pagedprefill info`` prints it."""
        parts = [f"{self.name} ({self.torch_device})", f"vendor={self.vendor}"]
        if self.type != "cpu":
            parts += [f"capability={self.capability[0]}.{self.capability[1]}", f"warp_size={self.warp_size}",
                      f"SMs={self.num_sms}", f"shared_mem/block={self.max_shared_mem // 1024} KiB"]
        parts.append(f"triton={self.triton_backend or self._no_triton_reason()}")
        return ", ".join(parts)

    def _no_triton_reason(self) -> str:
        """Why Triton has no target for this device: not installed, or installed without a driver for it."""
        if not triton_installed():
            return "none (Triton is not installed)"
        if self.type == "cpu":
            return "none (Triton is installed but has no CPU driver; TRITON_INTERPRET=1 runs its interpreter)"
        return f"none (Triton is installed but has no driver for {self.type})"

    @classmethod
    def detect(cls, device: DeviceLike = None) -> DeviceInfo:
        """Describe ``device`` (default: the current CUDA device if there is one, else the CPU)."""
        return _detect(_normalise(device))


def _normalise(device: DeviceLike) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def interpreter_enabled() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


@functools.cache
def _detect(device: torch.device) -> DeviceInfo:
    if device.type == "cpu":
        backend = "interpreter" if interpreter_enabled() and triton_installed() else None
        import platform

        return DeviceInfo(type="cpu", vendor="cpu", name=platform.processor() or platform.machine() or "cpu",
                          triton_backend=backend)
    if device.type == "cuda":
        return _detect_cuda(device)
    return DeviceInfo(type=device.type, index=device.index, vendor=device.type, name=str(device))


def _cuda_vendor(name: str) -> str:
    override = os.environ.get("PAGEDPREFILL_VENDOR")
    if override:
        return override.strip().lower()
    if getattr(torch.version, "hip", None):
        return "amd"
    if name.lower().startswith("iluvatar") or "+corex" in torch.__version__ or hasattr(torch, "corex"):
        return "iluvatar"
    if "metax" in name.lower():
        return "metax"
    return "nvidia"


def _detect_cuda(device: torch.device) -> DeviceInfo:
    props = torch.cuda.get_device_properties(device)
    vendor = _cuda_vendor(props.name)
    warp = int(getattr(props, "warp_size", 0) or (64 if vendor in ("iluvatar", "amd") else 32))
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    num_sms = int(props.multi_processor_count)
    backend = None
    if triton_installed() and not interpreter_enabled():
        backend, tprops = _triton_view(device.index)
        smem = int(tprops.get("max_shared_mem", 0)) or smem
        warp = int(tprops.get("warpSize", 0)) or warp
    if not smem:
        smem = DEFAULT_SHARED_MEM.get(vendor, 48 * 1024)
    return DeviceInfo(type="cuda", index=device.index, vendor=vendor, name=props.name,
                      capability=(props.major, props.minor), warp_size=warp, num_sms=num_sms,
                      max_shared_mem=smem, triton_backend=backend)


def _triton_view(index: int) -> tuple[Optional[str], dict]:
    """Triton's own view of the device: target backend name and its device properties (best effort)."""
    try:
        from triton.runtime import driver

        active = driver.active
        target = active.get_current_target()
        props = active.utils.get_device_properties(index)
        return str(target.backend), dict(props)
    except Exception:  # no driver for this device, or an older Triton without these calls
        return None, {}
