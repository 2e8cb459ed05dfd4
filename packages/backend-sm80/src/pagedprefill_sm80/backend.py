"""The ``sm80`` backend: core's Triton kernel with measured tiles for NVIDIA sm80+, and a warp-specialised
kernel of its own for sm90 (:mod:`pagedprefill_sm80.hopper`) where the policy chooses it."""

from __future__ import annotations

import functools

from pagedprefill.backends.routes import PORTABLE
from pagedprefill.backends.triton_base import TritonBackend
from pagedprefill.device import DeviceInfo
from pagedprefill.tiling import ProblemShape, TileConfig
from pagedprefill.tuning import tables_state
from pagedprefill.variables import EnvironmentVariable

from .hopper import schedule
from .hopper.route import HOPPER
from .policy import (
    KERNEL_CHOICES,
    KERNEL_ENV,
    choose_kernel,
    hopper_schedule,
    kernel_preference,
    portable_config,
    search_space,
    sm80_policy,
)

MIN_CAPABILITY = (8, 0)


class Sm80Backend(TritonBackend):
    name = "sm80"
    priority = 200
    description = "Triton kernels tuned for NVIDIA sm80+ (A100, L40, H100/H200, B200)"
    policy = staticmethod(sm80_policy)
    #: Core's kernel, and the Hopper kernel where the policy names it and the call fits it.
    routes = {PORTABLE.name: PORTABLE, HOPPER.name: HOPPER}
    #: Checked at every selection, so a misspelt value is an error naming the variable on any machine, not only
    #: when a policy runs on sm90.
    environment_variables = (
        EnvironmentVariable(KERNEL_ENV, "the kernel sm80 runs on sm90 GPUs", choices=KERNEL_CHOICES),
        EnvironmentVariable(schedule.SCHEDULE_ENV, "the Hopper kernel's schedule flags", check=schedule.parse),
    )

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

    def tile_config(self, shape: ProblemShape, device: DeviceInfo) -> TileConfig:
        """The policy's tile, remembered per shape, device, tuned tables and kernel preference."""
        return self._policy_memo(shape, device, (tables_state(), kernel_preference()))

    def portable_tile(self, shape: ProblemShape, device: DeviceInfo) -> TileConfig:
        """Core's kernel runs the policy's tile, or where the policy chose the Hopper kernel (and a call falls
        back: tensors a TMA view cannot address) the portable kernel's own tile for the shape."""
        config = self.tile_config(shape, device)
        if config.kernel != "hopper":
            return config
        return self._portable_memo(shape, device, tables_state())

    @functools.cached_property
    def _portable_memo(self):
        return functools.lru_cache(maxsize=1024)(lambda shape, device, tables: portable_config(shape, device))

    def kernel_choice(self, shape: ProblemShape, device: DeviceInfo) -> tuple[str, str]:
        """The policy's kernel and why, naming the schedule flags it sets for the Hopper kernel's route."""
        kernel, why = choose_kernel(shape, device)
        if kernel != "hopper":
            return kernel, why
        config = self.tile_config(shape, device)
        flags = [name for name, on in hopper_schedule(shape, config.block_n).items() if on]
        why += f"; schedule {'+'.join(flags)}" if flags else ""
        if config.key_splits > 1:
            why += f"; each tile's keys split {config.key_splits} ways (the launch would not fill the GPU)"
        return kernel, why

    def search_space(self, shape: ProblemShape, device: DeviceInfo) -> list[TileConfig]:
        """Candidates ``pagedprefill tune`` measures for ``shape`` on ``device``."""
        return search_space(shape, device)
