"""Optional features a backend may not run, and the one check that refuses them.

A backend lists the features it computes in its ``supported_features`` attribute (a set of names from
:data:`pagedprefill.types.FEATURES`); a backend without that attribute supports none of them. The
``reference`` backend supports all of them. :func:`check_features` is called by dispatch (and by the
conformance suite) before a backend runs.
"""

from __future__ import annotations

from .errors import UnsupportedFeatureError
from .options import FEATURES, KV_IN_CACHE, OPTIONS
from .types import PrefillProblem

__all__ = ["FEATURES", "FEATURE_DESCRIPTIONS", "check_features", "missing_features"]

#: How errors describe each feature (the argument the caller sets to use it), from the options' description.
FEATURE_DESCRIPTIONS = dict([KV_IN_CACHE, *(o.feature for o in OPTIONS if o.feature)])


def missing_features(backend, problem: PrefillProblem) -> frozenset:
    """The features ``problem`` uses that ``backend`` does not declare in ``supported_features``."""
    used = problem.features
    if not used:
        return frozenset()
    return used - frozenset(getattr(backend, "supported_features", ()))


def check_features(backend, problem: PrefillProblem) -> None:
    """Raise :class:`~pagedprefill.UnsupportedFeatureError` naming each feature ``problem`` uses that
    ``backend`` does not run."""
    missing = missing_features(backend, problem)
    if missing:
        what = "; ".join(_describe(name) for name in sorted(missing))
        raise UnsupportedFeatureError(
            f"backend {backend.name!r} does not support {what}; use backend='reference', which runs every feature"
        )


def _describe(name: str) -> str:
    """The argument the caller set, and the feature's name (as ``supported_features`` spells it) where the
    argument does not already say it."""
    description = FEATURE_DESCRIPTIONS[name]
    return description if description.startswith(name) else f"{description} (feature {name!r})"

