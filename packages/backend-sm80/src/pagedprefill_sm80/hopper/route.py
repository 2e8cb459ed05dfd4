"""The Hopper kernel as a route of the sm80 backend: what the backend calls when a tile names ``"hopper"``.

The launcher and the kernel import Gluon, so they are imported when a call first takes this route, not when the
backend is selected.
"""

from __future__ import annotations

from typing import Optional

from pagedprefill.backends.routes import KernelRoute, Launcher
from pagedprefill.device import DeviceInfo
from pagedprefill.tiling import ProblemShape, TileConfig
from pagedprefill.types import PrefillProblem

from .schedule import shape_unfit_reason


class HopperRoute(KernelRoute):
    """sm80's warp-specialised sm90 kernel (:mod:`pagedprefill_sm80.hopper.kernel`)."""

    name = "hopper"
    title = "Hopper kernel"

    def unfit_reason(self, problem: PrefillProblem, config: TileConfig, shape: ProblemShape,
                     device: DeviceInfo) -> Optional[str]:
        """The tile must fit the kernel and the device's shared memory, and the tensors a TMA view (strides,
        16-byte alignment)."""
        from .launch import unfit_reason

        return shape_unfit_reason(shape, config, device.max_shared_mem) or unfit_reason(problem, config)

    def run(self, problem: PrefillProblem, config: TileConfig, shape: ProblemShape) -> None:
        from .launch import launch_hopper

        launch_hopper(problem, config, shape)

    def bind(self, problem: PrefillProblem, config: TileConfig, shape: ProblemShape) -> Optional[Launcher]:
        from .launch import bind_hopper

        return bind_hopper(problem, config, shape)

    def compile(self, problem: PrefillProblem, config: TileConfig, capability: int):
        from pagedprefill.tiling import problem_shape
        from pagedprefill.triton.codegen import compile_call

        from .kernel import hopper_prefill_kernel
        from .launch import kernel_call

        call = kernel_call(problem, config, problem_shape(problem))
        if call is None:
            raise ValueError("problem: has nothing to compute (no tokens, sequences or heads)")
        return compile_call(hopper_prefill_kernel, call, capability)


#: The route the sm80 backend adds to core's kernel.
HOPPER = HopperRoute()
