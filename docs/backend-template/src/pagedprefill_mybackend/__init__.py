"""pagedprefill-mybackend: a pagedprefill backend for myvendor accelerators (a template to copy)."""

from .backend import MyBackend
from .detect import VENDOR, detect_mine
from .policy import my_policy

__all__ = ["VENDOR", "MyBackend", "detect_mine", "my_policy"]
