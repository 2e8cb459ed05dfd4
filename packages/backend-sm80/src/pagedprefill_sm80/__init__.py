"""pagedprefill-sm80: the fast Triton backend for NVIDIA GPUs of compute capability 8.0 and newer."""

from .backend import Sm80Backend
from .policy import sm80_policy

__all__ = ["Sm80Backend", "sm80_policy"]
