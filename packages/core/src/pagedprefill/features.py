"""Optional features a backend may not run, and the one check that refuses them.

A backend lists the features it computes in its ``supported_features`` attribute (a set of names from
:data:`pagedprefill.options.FEATURES`; ``Backend`` declares none). The ``reference`` backend and core's Triton
kernel support all of them. :func:`check_runnable` is what runs before a backend computes a call (in dispatch,
once per call signature, and in the tools that call a backend directly): :func:`check_features`, then the
backend's own ``check_problem``.
"""

from __future__ import annotations

from .errors import UnsupportedFeatureError
from .options import FEATURES, FP8_QUERY, KV_IN_CACHE, OPTIONS
from .types import PrefillProblem

__all__ = ["FEATURES", "FEATURE_DESCRIPTIONS", "check_features", "check_runnable", "missing_features"]

#: How errors describe each feature (the argument the caller sets to use it), from the options' description.
FEATURE_DESCRIPTIONS = dict([KV_IN_CACHE, FP8_QUERY, *(o.feature for o in OPTIONS if o.feature)])


def missing_features(backend, problem: PrefillProblem) -> frozenset:
    """The features ``problem`` uses that ``backend`` does not declare in ``supported_features``."""
    used = problem.features
    if not used:
        return frozenset()
    return used - frozenset(backend.supported_features)


def check_features(backend, problem: PrefillProblem) -> None:
    """Raise :class:`~pagedprefill.UnsupportedFeatureError` naming each feature ``problem`` uses that
    ``backend`` does not run."""
    missing = missing_features(backend, problem)
    if missing:
        what = "; ".join(_describe(name) for name in sorted(missing))
        raise UnsupportedFeatureError(
            f"backend {backend.name!r} does not support {what}; use backend='reference', which runs every feature"
        )


def check_runnable(backend, problem: PrefillProblem, device) -> None:
    """Raise :class:`~pagedprefill.UnsupportedFeatureError` when ``backend`` cannot compute ``problem`` (already
    validated) on ``device``: a feature it does not declare, or its own ``check_problem``'s refusal."""
    check_features(backend, problem)
    backend.check_problem(problem, device)


def _describe(name: str) -> str:
    """The argument the caller set, and the feature's name (as ``supported_features`` spells it) where the
    argument does not already say it."""
    description = FEATURE_DESCRIPTIONS[name]
    return description if description.startswith(name) else f"{description} (feature {name!r})"

