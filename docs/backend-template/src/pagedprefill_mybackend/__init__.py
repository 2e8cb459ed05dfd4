"""pagedprefill-mybackend: a pagedprefill backend for myvendor accelerators (a template to copy)."""

from .backend import VENDOR, MyBackend
from .policy import my_policy

__all__ = ["VENDOR", "MyBackend", "my_policy"]
