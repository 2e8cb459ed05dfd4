"""Kernel routes: each kernel a Triton backend can launch, as one object that runs, binds and compiles a problem.

A backend's policy names the kernel of each tile (:attr:`~pagedprefill.tiling.TileConfig.kernel`); the backend
looks the name up in its :attr:`~pagedprefill.backends.triton_base.TritonBackend.routes` and hands the call to
that route. Core's kernel is :data:`PORTABLE`; a backend with a kernel of its own adds a route for it, and says in
:meth:`KernelRoute.unfit_reason` which calls the kernel cannot take (those fall back to :data:`PORTABLE` with the
backend's portable tile). The backend itself then has no per-kernel branches.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..device import DeviceInfo
from ..tiling import ProblemShape, TileConfig
from ..types import PrefillProblem

#: What :meth:`KernelRoute.bind` returns: a launcher of the compiled kernel for later problems of the same call
#: signature (True when it launched), or None when the first call was run another way and later ones run again.
Launcher = Callable[[PrefillProblem], bool]


class KernelRoute:
    """One kernel: how it runs a problem with a tile, binds a launcher for later calls, and compiles ahead of time.

    Subclasses set :attr:`name` (the :attr:`TileConfig.kernel <pagedprefill.tiling.TileConfig.kernel>` value that
    routes here) and :attr:`title` (how errors name the kernel), and implement the three methods.
    """

    name: str = "unnamed"
    title: str = "kernel"

    def unfit_reason(self, problem: PrefillProblem, config: TileConfig, shape: ProblemShape,
                     device: DeviceInfo) -> Optional[str]:
        """Why this kernel cannot take ``problem`` with ``config`` on ``device`` (tile too large for its shared
        memory, strides it cannot address), or None when it can. Core's kernel takes every validated call."""
        return None

    def run(self, problem: PrefillProblem, config: TileConfig, shape: ProblemShape) -> None:
        """Compute ``problem`` into ``problem.out`` with the tile ``config``."""
        raise NotImplementedError

    def bind(self, problem: PrefillProblem, config: TileConfig, shape: ProblemShape) -> Optional[Launcher]:
        """Compute ``problem`` and return a launcher for later problems of its signature, or None when there is
        none to give (nothing to launch, or a driver without direct launches): the caller then runs each later
        problem again."""
        raise NotImplementedError

    def compile(self, problem: PrefillProblem, config: TileConfig, capability: int):
        """The kernel that would run ``problem`` with ``config``, compiled for NVIDIA ``sm_<capability>`` without a
        GPU (for the codegen report)."""
        raise NotImplementedError


class PortableRoute(KernelRoute):
    """Core's Triton kernel (:mod:`pagedprefill.triton`): every Triton backend has it, and it takes every call."""

    name = "portable"
    title = "portable kernel"

    def run(self, problem: PrefillProblem, config: TileConfig, shape: ProblemShape) -> None:
        from ..triton.launch import launch_prefill

        launch_prefill(problem, config, shape)

    def bind(self, problem: PrefillProblem, config: TileConfig, shape: ProblemShape) -> Optional[Launcher]:
        from ..triton.launch import bind_launch, call_tensors

        bound = bind_launch(problem, config, shape)
        if bound is None:
            return None
        splits = config.key_splits

        def launch(later: PrefillProblem) -> bool:
            return bound(call_tensors(later, splits))

        return launch

    def compile(self, problem: PrefillProblem, config: TileConfig, capability: int):
        from ..triton.codegen import compile_for_target

        return compile_for_target(problem, config, capability)


#: Core's kernel, the route every Triton backend starts from.
PORTABLE = PortableRoute()
