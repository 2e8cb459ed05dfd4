"""The exceptions pagedprefill raises beyond Python's own.

This module imports nothing from the package, so every layer can raise them (see docs/architecture.md,
"Layers"). They are also importable from :mod:`pagedprefill`, :mod:`pagedprefill.registry` and
:mod:`pagedprefill.registry.backend`.
"""

from __future__ import annotations

__all__ = ["BackendUnavailableError", "UnsupportedFeatureError"]


class BackendUnavailableError(RuntimeError):
    """No backend (or not the requested one) can run on the device; the message says why."""


class UnsupportedFeatureError(ValueError):
    """The selected backend cannot compute this call (a feature its hardware lacks); names alternatives."""
