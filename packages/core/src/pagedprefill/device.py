"""What a device is: vendor, name, capability, warp size, SM count, shared memory, Triton backend.

:class:`DeviceInfo` is a frozen value. ``DeviceInfo.detect()`` reads it from the runtime (once per device and
registry, cached); tests and tools build one by hand to describe hardware that is not present.

Detection has three steps (see :meth:`pagedprefill.registry.Registry.detect_device`):

1. :func:`general_info`: what torch and Triton report for any device type, through device-generic calls
   (``torch.get_device_module(type).get_device_properties``, Triton's active driver). The vendor here is
   torch's own view: a ``cuda`` device of a ROCm build of torch (``torch.version.hip``) is ``amd``, another
   ``cuda`` device ``nvidia``, any other type is named by its type (``xpu``, ``npu``, ``mlu``...). Values
   nobody reported are left at 0.
2. The ``pagedprefill_detect_device`` hook: a backend package recognises its own hardware and returns a
   refined description (the first answer wins). Vendors whose parts present themselves as ``cuda``
   (Iluvatar CoreX in ``pagedprefill-bi100``, MetaX in ``pagedprefill-generic``) are told apart there, so
   core holds no vendor's rules.
3. :func:`fill_defaults`: what is still unknown gets conservative general values.

``PAGEDPREFILL_VENDOR`` overrides the vendor of accelerator devices: the hooks see it, and it wins over
their answer. Capability alone never decides the vendor: an NVIDIA V100 and an Iluvatar BI-V100 both
report (7, 0).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

DeviceLike = Union[str, int, torch.device, None]

#: Environment variable that sets the vendor of accelerator devices, whatever detection says.
ENV_VENDOR = "PAGEDPREFILL_VENDOR"

#: Shared memory per block assumed when neither the runtime nor a plugin says: what CUDA guarantees to
#: every block without opt-in, and the local data share of a HIP work-group.
FALLBACK_SHARED_MEM = 48 * 1024
FALLBACK_SHARED_MEM_HIP = 64 * 1024


@dataclass(frozen=True)
class DeviceInfo:
    """A description of one device, detected or written by hand.

    Attributes:
        type: torch device type (``"cuda"``, ``"cpu"``, ``"xpu"``, ``"npu"``...).
        index: device index, or None for the CPU.
        vendor: a lower-case name: ``nvidia`` or ``amd`` for torch's ``cuda`` devices, what a backend's
            detection hook says for hardware it recognises (``iluvatar``, ``metax``, ...), ``cpu``, or the
            device type when nothing more is known.
        name: the runtime's device name (e.g. ``"NVIDIA H200"``, ``"Iluvatar BI-V100"``).
        capability: ``(major, minor)`` as reported ((0, 0) when the device type has none).
        warp_size: threads per warp (64 on Iluvatar and AMD CDNA); 0 in a description means not reported.
        num_sms: streaming multiprocessors / compute units (1 when not reported).
        max_shared_mem: shared memory available to one block, in bytes (opt-in maximum); 0 in a
            description means not reported.
        triton_backend: the target of Triton's active driver for this device (``"cuda"``, ``"hip"``,
            ``"xpu"``, ``"corex"``...), ``"interpreter"`` for the CPU under ``TRITON_INTERPRET=1``, or None
            when Triton is not installed or its active driver does not serve this device.
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

    def replace(self, **changes) -> DeviceInfo:
        """A copy with ``changes`` applied (what a detection hook returns after recognising a device)."""
        return dataclasses.replace(self, **changes)

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
        """Describe ``device`` (default: the current accelerator if there is one, else the CPU).

        Asks the installed backends' ``pagedprefill_detect_device`` hooks, through the detection the dispatch
        layer installs when the package is imported (:func:`install_detection`).
        """
        if _detection is None:
            raise RuntimeError("device detection: no detection is installed; import pagedprefill first")
        return _detection(normalise(device))


#: How :meth:`DeviceInfo.detect` describes a device: set by the layer that holds the backends' detection hooks
#: (the process-wide registry), which imports this module; this one imports nothing above it.
_detection: Optional[Callable[[torch.device], DeviceInfo]] = None


def install_detection(detect: Callable[[torch.device], DeviceInfo]) -> None:
    """Make :meth:`DeviceInfo.detect` answer through ``detect`` (a device with its index filled in -> its
    description)."""
    global _detection
    _detection = detect


def normalise(device: DeviceLike) -> torch.device:
    """``device`` as a torch device with its index filled in (an int means an index of the accelerator)."""
    if isinstance(device, int):  # an index of the accelerator (of CUDA's, as torch reads it, when none)
        return torch.device(current_accelerator_type() or "cuda", device)
    if device is None:
        accel = current_accelerator_type()
        return _with_index(torch.device(accel)) if accel is not None else torch.device("cpu")
    return _with_index(torch.device(device))


def current_accelerator_type() -> Optional[str]:
    """The device type of torch's current accelerator (``"cuda"``, ``"xpu"``...), or None if there is none."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        current = accelerator.current_accelerator()
        return current.type if current is not None and accelerator.is_available() else None
    return "cuda" if torch.cuda.is_available() else None


def _with_index(device: torch.device) -> torch.device:
    if device.type == "cpu" or device.index is not None:
        return device
    try:
        return torch.device(device.type, torch.get_device_module(device.type).current_device())
    except Exception:  # a type without a runtime here, or without a notion of current device
        return device


def interpreter_enabled() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


#: What installs what Triton's interpreter needs (the ``interpreter`` extra of core and of generic).
INTERPRETER_FIX = ('pip install "numpy<2.4" (or the interpreter extra: '
                   'pip install "./packages/backend-generic[interpreter]")')


def interpreter_unready() -> Optional[str]:
    """Why Triton's CPU interpreter cannot run kernels here, with the fix; None when it can.

    The interpreter runs kernels on numpy arrays, so it needs numpy; and the interpreter of the Triton
    releases the packages allow (up to 3.6) converts 1-element arrays to Python scalars, which numpy 2.4
    refuses ("only 0-dimensional arrays can be converted to Python scalars"). Read from the installed
    distributions' metadata, without importing numpy or Triton.
    """
    import importlib.util
    from importlib import metadata

    try:
        found = importlib.util.find_spec("numpy") is not None
        numpy_version = metadata.version("numpy")
    except (ImportError, metadata.PackageNotFoundError):
        found = False
    if not found:
        return f"Triton's interpreter needs numpy, which is not installed: {INTERPRETER_FIX}"
    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:  # a vendor's build under another distribution name: no rule known
        return None
    if _release(triton_version) < (3, 7) and _release(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter needs numpy < 2.4, but numpy {numpy_version} is "
                f"installed: {INTERPRETER_FIX}")
    return None


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of ``version`` ("2.4.0rc1" -> (2, 4, 0)), enough to compare releases."""
    import re

    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def vendor_override() -> Optional[str]:
    """The vendor named by ``PAGEDPREFILL_VENDOR`` (lower case), or None."""
    value = os.environ.get(ENV_VENDOR, "").strip().lower()
    return value or None


def general_info(device: torch.device) -> DeviceInfo:
    """What torch and Triton report about ``device``, with no vendor's rules (step 1 of detection)."""
    if device.type == "cpu":
        import platform

        backend = "interpreter" if interpreter_enabled() and triton_installed() else None
        return DeviceInfo(type="cpu", vendor="cpu", name=platform.processor() or platform.machine() or "cpu",
                          triton_backend=backend)
    props = _torch_properties(device)
    # torch's own view of its ``cuda`` type: a ROCm build runs AMD GPUs, a CUDA build NVIDIA's (parts of
    # other vendors that present themselves as ``cuda`` are recognised by their backend's hook).
    vendor = ("amd" if _is_hip(device.type) else "nvidia") if device.type == "cuda" else device.type
    capability = (int(getattr(props, "major", 0) or 0), int(getattr(props, "minor", 0) or 0))
    warp = int(getattr(props, "warp_size", 0) or 0)
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    sms = int(getattr(props, "multi_processor_count", 0) or 0)
    backend = None
    if triton_installed() and not interpreter_enabled():
        backend, tprops = _triton_view(device)
        smem = int(tprops.get("max_shared_mem", 0) or 0) or smem
        warp = int(tprops.get("warpSize", 0) or 0) or warp
        sms = sms or int(tprops.get("multiprocessor_count", 0) or 0)
    return DeviceInfo(type=device.type, index=device.index, vendor=vendor,
                      name=str(getattr(props, "name", "") or device), capability=capability, warp_size=warp,
                      num_sms=max(1, sms), max_shared_mem=smem, triton_backend=backend)


def fill_defaults(info: DeviceInfo) -> DeviceInfo:
    """``info`` with conservative values where nothing reported one (step 3 of detection)."""
    if info.type == "cpu":
        return info
    hip = _is_hip(info.type)
    changes = {}
    if info.warp_size <= 0:
        changes["warp_size"] = 64 if hip else 32
    if info.max_shared_mem <= 0:
        changes["max_shared_mem"] = FALLBACK_SHARED_MEM_HIP if hip else FALLBACK_SHARED_MEM
    return info.replace(**changes) if changes else info


def _is_hip(device_type: str) -> bool:
    """A ``cuda`` device of a ROCm build of torch."""
    return device_type == "cuda" and bool(getattr(torch.version, "hip", None))


def _torch_properties(device: torch.device) -> object:
    """torch's device properties of ``device`` through its device module (None if torch cannot tell)."""
    try:
        module = torch.get_device_module(device.type)
        return module.get_device_properties(device.index if device.index is not None else 0)
    except Exception:  # no runtime for this type in this build, or no such call
        return None


def _triton_view(device: torch.device) -> tuple[Optional[str], dict]:
    """Triton's active driver's view of ``device``: its target backend and device properties (best effort).

    The driver serves one device type; when it can say which (``get_active_torch_device``, Triton >= 3.2)
    and that is not ``device``'s type, Triton cannot run on ``device``.
    """
    try:
        from triton.runtime import driver

        active = driver.active
        serves = getattr(active, "get_active_torch_device", None)
        if serves is not None and serves().type != device.type:
            return None, {}
        target = active.get_current_target()
        try:
            props = dict(active.utils.get_device_properties(device.index or 0))
        except Exception:  # a driver without this call still tells its target
            props = {}
        return str(target.backend), props
    except Exception:  # no driver for this machine, or an older Triton without these calls
        return None, {}
