"""What ``import pagedprefill`` gives: the public names, the custom operators registered with torch, and the
backend chosen for the current device at import.

The package's ``__init__`` imports this module at once, except in the ``pagedprefill`` command, which imports
it when a subcommand runs (see the package's docstring).
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

with warnings.catch_warnings():
    # torch warns "Failed to initialize NumPy" when it first meets a missing numpy (at its import, or when
    # custom operators register); core declares numpy, but an environment installed with --no-deps (a vendor's
    # SDK) may lack it, and the reference backend runs without it.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

    from . import ops  # registers torch.ops.pagedprefill.prefill_attention(_) for torch.compile / CUDA graphs
from .api import (
    available_backends,
    context_attention_fwd,
    dispatch,
    get_registry,
    prefill_attention,
    reset_registry,
    select_backend,
)
from .cache import allocate_cache, fp8_scale_for, gather_kv, quantize_fp8, write_to_cache
from .device import DeviceInfo
from .errors import BackendUnavailableError, DeviceUnavailableError, UnsupportedFeatureError
from .reference_impl import reference_prefill
from .registry import ENTRY_POINT_GROUP, ENV_BACKEND, Backend, hookimpl
from .tiling import ProblemShape, TileConfig, TilingPolicy
from .types import AttentionOptions, BatchMetadata, KVCacheDType, KVLayout, PagedKVCache, PrefillProblem
from .validation import validate_problem

__all__ = [
    "AttentionOptions", "Backend", "BackendUnavailableError", "BatchMetadata", "DeviceInfo",
    "DeviceUnavailableError", "ENTRY_POINT_GROUP",
    "ENV_BACKEND", "KVCacheDType", "KVLayout", "PagedKVCache", "PrefillProblem", "ProblemShape", "TileConfig",
    "TilingPolicy", "UnsupportedFeatureError", "allocate_cache", "available_backends", "context_attention_fwd",
    "dispatch", "fp8_scale_for", "gather_kv", "get_registry", "hookimpl", "import_selection", "ops",
    "prefill_attention", "quantize_fp8", "reference_prefill", "reset_registry", "select_backend", "validate_problem",
    "write_to_cache",
]

_import_selection: Optional[Backend] = None


def import_selection() -> Optional[Backend]:
    """The backend chosen for the current device at import (None if deferred or if nothing fit)."""
    return _import_selection


if os.environ.get("PAGEDPREFILL_LAZY_SELECT", "0") in ("", "0"):
    try:
        # Quietly: nothing runs yet, so a fallback is told at the first call or select_backend() that returns it.
        _import_selection = get_registry().select(DeviceInfo.detect(), warn=False)
    except Exception:  # never fail the import; the first call raises the full explanation
        pass
