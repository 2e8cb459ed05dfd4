"""Test support shipped with pagedprefill: random paged batches and the backend conformance suite.

The pytest plugin in :mod:`pagedprefill.testing.plugin` is registered through the ``pytest11`` entry point,
so its options and fixtures are available wherever pagedprefill is installed.
"""

from .batches import BatchSpec, fresh_output, make_problem, with_output
from .conformance import (
    CASES,
    DEFAULT_TOLERANCES,
    ConformanceSuite,
    assert_matches_reference,
    case_spec,
    random_spec,
)

__all__ = ["CASES", "DEFAULT_TOLERANCES", "BatchSpec", "ConformanceSuite", "assert_matches_reference",
           "case_spec", "fresh_output", "make_problem", "random_spec", "with_output"]
