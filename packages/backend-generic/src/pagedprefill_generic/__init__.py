"""pagedprefill-generic: the portable Triton backend (any Triton device, and the CPU interpreter)."""

from .backend import GenericBackend
from .policy import generic_policy

__all__ = ["GenericBackend", "generic_policy"]
