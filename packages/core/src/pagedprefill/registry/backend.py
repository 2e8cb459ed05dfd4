"""The backend interface every implementation (built-in or plugin) provides."""

from __future__ import annotations

from typing import Optional

from ..device import DeviceInfo
from ..tiling import ProblemShape, TileConfig, TilingPolicy
from ..types import PrefillProblem


class BackendUnavailableError(RuntimeError):
    """No backend (or not the requested one) can run on the device; the message says why."""


class UnsupportedFeatureError(ValueError):
    """The selected backend cannot compute this call (a feature its hardware lacks); names alternatives."""


class Backend:
    """Base class of a backend.

    Subclasses set :attr:`name`, :attr:`priority` and :attr:`description`, implement :meth:`supports`
    and :meth:`run`, and may provide a :attr:`policy`.

    Attributes:
        name: unique short name, used by ``backend=`` and ``PAGEDPREFILL_BACKEND``.
        priority: higher wins among backends that support a device (reference 0, generic 100, hardware
            specific 200 and up).
        description: one line for ``pagedprefill info``.
        policy: the tiling policy, or None for backends that do not tile.
    """

    name: str = "unnamed"
    priority: int = 0
    description: str = ""
    policy: Optional[TilingPolicy] = None

    def supports(self, device: DeviceInfo) -> list[str]:
        """Reasons this backend cannot run on ``device``; an empty list means it can."""
        raise NotImplementedError

    def check_problem(self, problem: PrefillProblem, device: DeviceInfo) -> None:
        """Raise :class:`UnsupportedFeatureError` if this backend cannot compute ``problem``."""

    def run(self, problem: PrefillProblem, device: DeviceInfo) -> None:
        """Compute ``problem`` into ``problem.out`` (inputs are already validated)."""
        raise NotImplementedError

    def tile_config(self, shape: ProblemShape, device: DeviceInfo) -> Optional[TileConfig]:
        """The tile this backend would use for ``shape`` on ``device`` (None if it does not tile)."""
        return self.policy(shape, device) if self.policy is not None else None

    def __repr__(self) -> str:
        return f"<pagedprefill backend {self.name!r} priority={self.priority}>"
