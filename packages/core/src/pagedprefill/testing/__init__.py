"""Test support shipped with pagedprefill: the backend conformance suite and its cases, and the random
paged batches of :mod:`pagedprefill.workloads` (re-exported here).

The pytest plugin in :mod:`pagedprefill.testing.plugin` is registered through the ``pytest11`` entry point,
so its options and fixtures are available wherever pagedprefill is installed. :class:`ConformanceSuite`
needs pytest and is imported on first access; the rest works without it.
"""

from ..workloads import BatchSpec, fresh_output, make_problem, with_output
from .cases import CASES, DEFAULT_TOLERANCES, assert_matches_reference, case_spec, random_spec
from .sdpa import sdpa_float64

__all__ = ["CASES", "DEFAULT_TOLERANCES", "BatchSpec", "ConformanceSuite", "assert_matches_reference",
           "case_spec", "fresh_output", "make_problem", "random_spec", "sdpa_float64", "with_output"]


def __getattr__(name):
    if name == "ConformanceSuite":
        from .conformance import ConformanceSuite

        return ConformanceSuite
    raise AttributeError(f"module 'pagedprefill.testing' has no attribute {name!r}")
