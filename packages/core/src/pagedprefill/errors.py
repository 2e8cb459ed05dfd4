"""The exceptions pagedprefill raises beyond Python's own.

This module imports nothing from the package, so every layer can raise them (see docs/architecture.md,
"Layers"). They are also importable from :mod:`pagedprefill`; the first two also from
:mod:`pagedprefill.registry` and :mod:`pagedprefill.registry.backend`.
"""

from __future__ import annotations

__all__ = ["BackendUnavailableError", "DeviceUnavailableError", "UnsupportedFeatureError"]


class BackendUnavailableError(RuntimeError):
    """No backend (or not the requested one) can run on the device; the message says why."""


class UnsupportedFeatureError(ValueError):
    """The selected backend cannot compute this call (a feature its hardware lacks); names alternatives."""


class DeviceUnavailableError(BackendUnavailableError, ValueError):
    """A ``device`` argument names a device this process cannot use (absent, or not built into this torch).

    Both a :class:`BackendUnavailableError` (nothing can run there) and a ``ValueError`` (a bad argument); the
    message names the argument and says what to do."""
