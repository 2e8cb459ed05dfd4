"""Shared base of backends that run core's Triton kernel with their own tiling policy."""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

from ..device import DeviceInfo, interpreter_enabled, interpreter_unready, triton_installed
from ..registry import Backend, UnsupportedFeatureError
from ..tiling import ProblemShape, TileConfig, problem_shape  # problem_shape: still importable from here
from ..tuning import tables_state
from ..types import FEATURES, FP8_QUERY_DTYPES, KVCacheDType, PrefillProblem
from ..validation import dtype_name
from .routes import PORTABLE, KernelRoute


def spec_shape(spec, twin) -> ProblemShape:
    """The shape a policy sees for the batch ``spec`` (a :class:`~pagedprefill.workloads.BatchSpec`), read off
    ``twin``, a short batch of the same kind (the tensors are built at the twin's size), with the extents of
    ``spec``'s own batch: the decisions depend on shapes, flags and extents, not on lengths."""
    from ..workloads import make_problem

    shape = problem_shape(make_problem(twin))
    return dataclasses.replace(shape, num_tokens=sum(spec.query_lens), num_seqs=len(spec.query_lens),
                               max_query_len=max(spec.query_lens))


def e4m3_arguments(problem: PrefillProblem) -> list[tuple[str, str]]:
    """``(the argument, what to pass instead)`` for each of ``problem``'s e4m3 tensors: its query, its cache, its
    output."""
    out = []
    if problem.q.dtype in FP8_QUERY_DTYPES:
        out.append(("q: dtype float8_e4m3fn", "pass q in the 16-bit type"))
    if problem.cache.dtype is KVCacheDType.FP8_E4M3:
        out.append((f"kv_cache_dtype={problem.cache.dtype.value!r}", "use kv_cache_dtype='fp8_e5m2' or an "
                                                                     "unquantised cache"))
    if problem.options.fp8_out_scale is not None:
        out.append(("fp8_out_scale (an FP8 e4m3 output)", "leave fp8_out_scale unset for a 16-bit output"))
    return out


class TritonBackend(Backend):
    """A backend made of core's Triton kernel plus a policy; subclasses add hardware checks.

    Subclasses implement :meth:`hardware_reasons` (why the device is not theirs) and set :attr:`policy`. A
    subclass with kernels of its own adds their :class:`~pagedprefill.backends.routes.KernelRoute` to
    :attr:`routes`; its policy names them in each tile, and every call goes to its tile's route.
    """

    #: The kernels this backend launches, by the name a tile's :attr:`~pagedprefill.tiling.TileConfig.kernel`
    #: gives: core's kernel, which takes every call a kernel of a subclass's own cannot.
    routes: Mapping[str, KernelRoute] = {PORTABLE.name: PORTABLE}

    #: Whether the backend accepts CPU tensors under ``TRITON_INTERPRET=1``.
    runs_in_interpreter = False

    #: Optional features (names from :data:`pagedprefill.options.FEATURES`: ``"kv_in_cache"``,
    #: ``"non_causal"``, ``"skip_decode"``, ``"fp8_out_scale"``) the kernel computes: all of them. A subclass
    #: for hardware that lacks one (FP8 stores, say) removes its name; the dispatch then refuses it with
    #: :class:`UnsupportedFeatureError` naming it.
    supported_features: frozenset = FEATURES

    def hardware_reasons(self, device: DeviceInfo) -> list[str]:
        return []

    def supports(self, device: DeviceInfo) -> list[str]:
        if not triton_installed():
            return ["Triton is not installed (pip install triton, or pip install \"./packages/core[triton]\" from "
                    "the repository)"]
        if device.type == "cpu":
            if not self.runs_in_interpreter:
                return ["runs on GPUs only, not on the CPU"]
            if not interpreter_enabled():
                return ["on the CPU it needs Triton's interpreter: set TRITON_INTERPRET=1"]
            unready = interpreter_unready()
            return [unready] if unready else []
        if interpreter_enabled():
            return [f"TRITON_INTERPRET=1 is set, which runs Triton on the CPU only, not on {device.type}"]
        if device.triton_backend is None:
            return [f"Triton has no active driver for {device.type} device {device.name!r}"]
        return self.hardware_reasons(device)

    @functools.cached_property
    def _policy_memo(self):
        def decide(shape: ProblemShape, device: DeviceInfo, tables: tuple) -> TileConfig:
            return self.policy(shape, device)

        return functools.lru_cache(maxsize=1024)(decide)

    def tile_config(self, shape: ProblemShape, device: DeviceInfo) -> TileConfig:
        """The policy's tile, remembered per (shape, device, tuned tables): no policy work on repeated launches,
        and a table written by ``pagedprefill tune`` (or forgotten) is used from the next launch on."""
        return self._policy_memo(shape, device, tables_state())

    def portable_tile(self, shape: ProblemShape, device: DeviceInfo) -> TileConfig:
        """The tile core's kernel runs for ``shape``: the policy's. A subclass whose policy can pick a tile of a
        kernel of its own returns one that core's kernel holds, for the calls that kernel does not take."""
        return self.tile_config(shape, device)

    def route_for(self, problem: PrefillProblem, device: DeviceInfo) -> tuple[KernelRoute, TileConfig, ProblemShape]:
        """The route that computes ``problem`` and the tile it runs: the policy's kernel and tile, or core's
        kernel with :meth:`portable_tile` where the policy's kernel cannot take this call."""
        shape = problem_shape(problem)
        config = self.tile_config(shape, device)
        route = self.routes[config.kernel]
        if route is not PORTABLE and route.unfit_reason(problem, config, shape, device) is None:
            return route, config, shape
        return PORTABLE, self.portable_tile(shape, device), shape

    def kernel_for(self, problem: PrefillProblem, device: DeviceInfo) -> str:
        """The name of the kernel that computes ``problem`` (:meth:`route_for`)."""
        return self.route_for(problem, device)[0].name

    def kernel_choice(self, shape: ProblemShape, device: DeviceInfo) -> tuple[str, str]:
        return "portable", "core's Triton kernel"

    def compile_for_target(self, problem: PrefillProblem, config: TileConfig, capability: int):
        """The kernel ``config`` names, compiled for ``problem`` ahead of time for NVIDIA ``sm_<capability>``
        without a GPU (for the codegen report)."""
        return self.routes[config.kernel].compile(problem, config, capability)

    def check_problem(self, problem: PrefillProblem, device: DeviceInfo) -> None:
        """Refuse a problem whose smallest tile cannot fit the device's shared memory, or one with e4m3 values (an
        FP8 q, an e4m3 cache, an FP8 output) on an NVIDIA GPU before sm89 (the optional features outside
        :attr:`supported_features` are refused before, by :func:`pagedprefill.features.check_runnable`)."""
        if device.vendor == "nvidia" and (0, 0) < device.capability < (8, 9):
            e4m3 = e4m3_arguments(problem)
            if e4m3:
                cap = f"{device.capability[0]}.{device.capability[1]}"
                raise UnsupportedFeatureError(
                    f"{' and '.join(what for what, _ in e4m3)} need{'s' if len(e4m3) == 1 else ''} an NVIDIA GPU of "
                    f"compute capability 8.9 or later (Triton has no e4m3 type before it), but {device.name} is "
                    f"{cap}; {', '.join(instead for _, instead in e4m3)}, or use backend='reference'")
        if device.type == "cpu" or not device.max_shared_mem:
            return
        shape = problem_shape(problem)
        config = self.portable_tile(shape, device)  # the fallback of any kernel of a subclass's own
        need = config.shared_mem_bytes(shape.head_size, shape.element_size)
        if need > device.max_shared_mem:
            raise UnsupportedFeatureError(
                f"head_size {shape.head_size} with {dtype_name(shape.dtype)} needs {need} bytes of "
                f"shared memory even with the smallest tile, but {device.name} has {device.max_shared_mem} per "
                f"block; use float16/bfloat16 inputs or backend='reference'")

    def run(self, problem: PrefillProblem, device: DeviceInfo) -> None:
        route, config, shape = self.route_for(problem, device)
        route.run(problem, config, shape)

    def run_tile(self, problem: PrefillProblem, config: TileConfig, device: DeviceInfo) -> None:
        """Run ``problem`` with the tile ``config`` on the kernel it names (for ``pagedprefill tune``); a tile that
        kernel cannot take for this call raises ``ValueError`` with the reason."""
        route = self.routes[config.kernel]
        shape = problem_shape(problem)
        reason = route.unfit_reason(problem, config, shape, device)
        if reason is not None:
            raise ValueError(f"config: the {route.title} {reason}")
        route.run(problem, config, shape)

    def bind(self, problem: PrefillProblem, device: DeviceInfo):
        """Run ``problem`` and return a launcher of the compiled kernel for its signature (on GPUs; the
        interpreter keeps launching through Triton's JIT)."""
        route, config, shape = self.route_for(problem, device)
        launch = route.bind(problem, config, shape)
        return launch if launch is not None else self.run_again(device)
