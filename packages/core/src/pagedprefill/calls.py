"""What the public functions share between their own signatures and :func:`~pagedprefill.runtime.dispatch`.

:func:`pagedprefill.prefill_attention`, :func:`pagedprefill.context_attention_fwd` and
:func:`pagedprefill.vllm.context_attention_fwd` each turn their arguments into a
:class:`~pagedprefill.PrefillProblem`, then hand it to :func:`dispatch_or_record`, which runs it now or, while
``torch.compile`` traces, records it as one custom operator. The drop-ins also spell "no window" as the
operators do, which :func:`drop_in_window` converts.

Internal: the package exports none of this (docs/architecture.md, "The path of a call", draws the whole path).
"""

from __future__ import annotations

import torch

from . import ops
from .options import BY_NAME
from .runtime import BackendChoice, dispatch
from .types import PrefillProblem
from .validation import NATIVE_NAMES, ArgumentNames, ValidateMode, argument_names_key, validate_tensors

__all__ = ["dispatch_or_record", "drop_in_window"]

_SLIDING_WINDOW = BY_NAME["sliding_window"]


def drop_in_window(sliding_window):
    """The drop-in signatures' ``sliding_window`` as the typed objects hold it: they spell "no window" as the
    operators do (None, or an int ``<= 0``), so :meth:`Option.from_schema` converts it to None."""
    return _SLIDING_WINDOW.from_schema(sliding_window)


def _backend_name(backend: BackendChoice) -> str:
    """The operators' spelling of a backend choice: its name, or ``""`` for the registry's choice."""
    if backend is None:
        return ""
    return backend if isinstance(backend, str) else backend.name


def dispatch_or_record(problem: PrefillProblem, backend: BackendChoice, validate: ValidateMode,
                       names: ArgumentNames = NATIVE_NAMES) -> torch.Tensor:
    """:func:`dispatch`, or while ``torch.compile`` traces, the in-place custom operator (same dispatch at
    run time, no data-dependent Python in the traced graph; its errors name the same arguments)."""
    if torch.compiler.is_compiling():
        validate_tensors(problem, names)  # names the caller's arguments; the operator checks options
        tensors, kwargs = ops.op_arguments(problem, _backend_name(backend))
        torch.ops.pagedprefill.prefill_attention_(*tensors[:3], problem.out, *tensors[3:], validate=validate,
                                                   argument_names=argument_names_key(names), **kwargs)
        return problem.out
    return dispatch(problem, backend=backend, validate=validate, names=names)
