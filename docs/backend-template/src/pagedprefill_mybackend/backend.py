"""The ``mybackend`` backend: core's Triton kernel with this package's tiling policy.

The hardware is recognised in :mod:`.detect`, which gives its devices the vendor :data:`VENDOR`; replace
:meth:`MyBackend.hardware_reasons` with what your kernels need. Until then the backend supports no real
device, so installing the template as it is never changes which backend a program uses.
"""

from __future__ import annotations

from pagedprefill import UnsupportedFeatureError
from pagedprefill.backends.triton_base import TritonBackend
from pagedprefill.device import DeviceInfo
from pagedprefill.types import PrefillProblem

from .detect import VENDOR
from .policy import my_policy

#: Smallest shared memory per block the policy's tiles are planned for (bytes).
MIN_SHARED_MEM = 32 * 1024


class MyBackend(TritonBackend):
    name = "mybackend"
    #: reference 0, generic 100, hardware-specific backends 200 and up. The template sits below the
    #: hardware-specific range; give a finished backend 200 or more so that it wins over generic.
    priority = 150
    description = f"Triton kernels tuned for {VENDOR} accelerators"  # follows VENDOR when you rename it
    policy = staticmethod(my_policy)

    #: KV-cache formats the hardware can read. Remove the FP8 ones if it has no float8 conversion (the
    #: conformance test then skips those formats, see tests/test_conformance.py).
    kv_cache_dtypes = frozenset({"auto", "fp8_e4m3", "fp8_e5m2"})
    #: Optional features the backend computes (core's kernel: all of them); core refuses the others before
    #: check_problem() runs. Remove a name your hardware cannot run, e.g. ``- {"fp8_out_scale"}``. The other
    #: members core asks about, with their defaults, are declared on ``pagedprefill.Backend``.
    supported_features = TritonBackend.supported_features

    def supports(self, device: DeviceInfo) -> list[str]:
        """Reasons this backend cannot run on ``device`` (empty: it can). Cheap, and never raises."""
        if device.vendor != VENDOR:
            return [f"{self.name} is for {VENDOR} devices, not vendor {device.vendor!r} ({device.name})"]
        # Triton installed, a Triton driver for the device, no TRITON_INTERPRET; then hardware_reasons().
        return super().supports(device)

    def hardware_reasons(self, device: DeviceInfo) -> list[str]:
        reasons = []
        # Also check what your kernels need of the part: a capability (for types that report one), a
        # Triton target (device.triton_backend)...
        if device.max_shared_mem and device.max_shared_mem < MIN_SHARED_MEM:
            reasons.append(f"needs {MIN_SHARED_MEM // 1024} KiB of shared memory per block, "
                           f"{device.name} has {device.max_shared_mem // 1024} KiB")
        return reasons

    def check_problem(self, problem: PrefillProblem, device: DeviceInfo) -> None:
        """Refuse calls the hardware cannot compute, naming what to do instead."""
        fmt = problem.cache.dtype.value
        if fmt not in self.kv_cache_dtypes:
            raise UnsupportedFeatureError(
                f"{self.name}: {device.name} cannot read {fmt} KV caches; store the cache in the model dtype "
                "(kv_cache_dtype='auto') or choose backend='generic' or backend='reference'"
            )
        super().check_problem(problem, device)  # the policy's tile must fit the device's shared memory
