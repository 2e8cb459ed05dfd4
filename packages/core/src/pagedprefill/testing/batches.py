"""Random paged batches: kept as an import path; the module is :mod:`pagedprefill.workloads`."""

from ..workloads import BatchSpec, fresh_output, make_problem, with_output

__all__ = ["BatchSpec", "fresh_output", "make_problem", "with_output"]
