"""Backend discovery and selection (see :mod:`pagedprefill.registry.manager` for the rules)."""

from .backend import Backend, BackendUnavailableError, UnsupportedFeatureError
from .fallback import Fallback, FallbackWarning
from .hookspecs import ENTRY_POINT_GROUP, hookimpl, hookspec
from .manager import ENV_BACKEND, BackendStatus, Registry

__all__ = ["Backend", "BackendStatus", "BackendUnavailableError", "ENTRY_POINT_GROUP", "ENV_BACKEND", "Fallback",
           "FallbackWarning", "Registry", "UnsupportedFeatureError", "hookimpl", "hookspec"]
