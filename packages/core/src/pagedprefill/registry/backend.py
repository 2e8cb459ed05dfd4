"""The backend interface every implementation (built-in or plugin) provides."""

from __future__ import annotations

from typing import Callable, Optional

from ..device import DeviceInfo
from ..errors import BackendUnavailableError, UnsupportedFeatureError
from ..tiling import ProblemShape, TileConfig, TilingPolicy
from ..types import PrefillProblem
from ..variables import EnvironmentVariable

__all__ = ["Backend", "BackendUnavailableError", "UnsupportedFeatureError"]  # the errors: re-exported


class Backend:
    """Base class of a backend: everything core asks a backend about is declared here, with its default.

    Subclasses set :attr:`name`, :attr:`priority` and :attr:`description`, implement :meth:`supports`
    and :meth:`run`, and may provide a :attr:`policy`.

    Attributes:
        name: unique short name, used by ``backend=`` and ``PAGEDPREFILL_BACKEND``.
        priority: higher wins among backends that support a device (reference 0, generic 100, hardware
            specific 200 and up).
        description: one line for ``pagedprefill info``.
        policy: the tiling policy, or None for backends that do not tile.
        supported_features: the optional features (names from :data:`pagedprefill.options.FEATURES`) the
            backend computes; dispatch refuses the others with :class:`UnsupportedFeatureError` naming them
            (:func:`pagedprefill.features.check_features`). None by default.
        environment_variables: the environment variables the backend reads
            (:class:`~pagedprefill.variables.EnvironmentVariable`, with the values each takes); selection refuses
            any other value with a ``ValueError`` naming the variable. None by default.
        reads_metadata_on_host: whether the backend reads the lengths and block table on the host anyway (the
            reference does). Dispatch then runs the ``"full"`` value checks even with ``validate="basic"``
            (a bad block number is a ``ValueError`` naming the argument, not an ``IndexError``) and keeps no
            launch plan for it. False by default: the Triton backends never read metadata on the host.
    """

    name: str = "unnamed"
    priority: int = 0
    description: str = ""
    policy: Optional[TilingPolicy] = None
    supported_features: frozenset = frozenset()
    environment_variables: tuple[EnvironmentVariable, ...] = ()
    reads_metadata_on_host: bool = False

    def supports(self, device: DeviceInfo) -> list[str]:
        """Reasons this backend cannot run on ``device``; an empty list means it can."""
        raise NotImplementedError

    def check_problem(self, problem: PrefillProblem, device: DeviceInfo) -> None:
        """Raise :class:`UnsupportedFeatureError` if this backend cannot compute ``problem`` on ``device``, for a
        reason beyond :attr:`supported_features` (checked before, by core). Nothing by default."""

    def run(self, problem: PrefillProblem, device: DeviceInfo) -> None:
        """Compute ``problem`` into ``problem.out`` (inputs are already validated)."""
        raise NotImplementedError

    def bind(self, problem: PrefillProblem, device: DeviceInfo) -> Callable[[PrefillProblem], bool]:
        """Compute ``problem`` (validated), and return how to compute later problems of the same call signature.

        The dispatch remembers what this returns per signature (:mod:`pagedprefill.plans`) and calls it with
        validation, selection and checks skipped; it returns False, computing nothing, when it cannot serve a
        call (which then takes the full path). The default runs :meth:`run` each time; a backend may return
        something faster (the Triton backends launch their compiled kernel directly).
        """
        self.run(problem, device)
        return self.run_again(device)

    def run_again(self, device: DeviceInfo) -> Callable[[PrefillProblem], bool]:
        """The plan that computes each later problem with :meth:`run`."""
        def again(later: PrefillProblem) -> bool:
            self.run(later, device)
            return True

        again.reruns = True  # the same path as the first call (tests need not compare the two)
        return again

    def kernel_for(self, problem: PrefillProblem, device: DeviceInfo) -> str:
        """Name of the kernel that computes ``problem`` on ``device``, for ``bench`` and tests (a backend with
        several kernels says which one its policy picked; by default the backend's own name)."""
        return self.name

    def kernel_choice(self, shape: ProblemShape, device: DeviceInfo) -> tuple[str, str]:
        """``(kernel, why)``: the kernel this backend's policy picks for calls of ``shape`` on ``device`` and the
        reason, for ``pagedprefill info`` (by default the backend's own name and no reason)."""
        return self.name, ""

    def search_space(self, shape: ProblemShape, device: DeviceInfo) -> list[TileConfig]:
        """The tiles ``pagedprefill tune`` measures for ``shape`` on ``device`` (none by default: nothing to
        tune). Each must be one the backend's kernel can run for ``shape``."""
        return []

    def run_tile(self, problem: PrefillProblem, config: TileConfig, device: DeviceInfo) -> None:
        """Run ``problem`` with the tile ``config`` instead of the policy's: how ``pagedprefill tune`` checks and
        times each tile of :meth:`search_space`. A backend that declares a search space implements it."""
        raise NotImplementedError(f"backend {self.name!r} runs only its policy's tiles (it declares no search space)")

    def tile_config(self, shape: ProblemShape, device: DeviceInfo) -> Optional[TileConfig]:
        """The tile this backend would use for ``shape`` on ``device`` (None if it does not tile)."""
        return self.policy(shape, device) if self.policy is not None else None

    def __repr__(self) -> str:
        return f"<pagedprefill backend {self.name!r} priority={self.priority}>"
