"""Launch plans: what the dispatch decided for one call signature, reused by every later call with it.

A serving engine calls the attention once per layer per step with the same shapes for many steps. The
first call with a signature is validated, a backend is selected, its policy picks a tile and Triton binds
and (maybe) compiles the kernel; the plan keeps the outcome. Later calls with the same signature only build
the signature, look the plan up and launch: no validation work, no policy, no argument binding.

The signature (:func:`call_signature`) holds everything those decisions read: every tensor's shape,
strides, dtype and device, every option's value, the cache layout and format, the backend asked for (and
``PAGEDPREFILL_BACKEND``), the argument names used in errors, and the state of the tuned tables. It holds no
tensor values: plans exist only for ``validate="basic"``, whose checks never read values either. A plan
whose compiled code assumed 16-byte aligned tensors declines a call with a less aligned one, which then
takes the full path.
"""

from __future__ import annotations

import operator
import threading
from typing import Callable, Optional

import torch

from .environment import variable
from .options import Option, held_by, tensor_form
from .tuning import tables_state
from .types import PrefillProblem

#: Plans kept at most; the table is emptied when full (a process rarely sees more signatures).
MAX_PLANS = 4096

#: ``plan(problem) -> bool``: launch ``problem``; False when it cannot (nothing was launched).
Plan = Callable[[PrefillProblem], bool]

#: The options a problem holds (a call's options are part of its signature).


def _may_hold_tensor(option: Option) -> bool:
    """Whether an option's value may be a tensor (its signature entry then describes the tensor instead)."""
    return option.schema is torch.Tensor or tensor_form(option.name) is not None


def _values_of(holder: str, tensors: bool) -> Callable[[object], tuple]:
    """A getter of the values of the options ``holder`` holds that may be tensors (``tensors``) or never are,
    as one tuple: one C-level call per object, since every call of the public functions builds a signature."""
    names = [o.attribute for o in held_by(holder) if _may_hold_tensor(o) == tensors]
    if not names:
        return lambda obj: ()
    get = operator.attrgetter(*names)
    return get if len(names) > 1 else lambda obj: (get(obj),)


_PLAIN = {holder: _values_of(holder, False) for holder in ("cache", "batch", "options")}
_TENSORS = {holder: _values_of(holder, True) for holder in ("cache", "batch", "options")}

#: ``PAGEDPREFILL_BACKEND``, which the registry's choice reads.
_backend_env = variable("PAGEDPREFILL_BACKEND")

_plans: dict = {}
_lock = threading.Lock()


def _tensor(t) -> tuple:
    if isinstance(t, torch.Tensor):
        return t.shape, t.stride(), t.dtype, t.device
    return (t,)  # None, or a float (scales): its value decides too


def call_signature(problem: PrefillProblem, backend: object, names: object) -> tuple:
    """Everything the dispatch's decisions for ``problem`` depend on, except tensor values and addresses: every
    tensor, and every option of the description (:data:`pagedprefill.options.OPTIONS`) the problem holds."""
    p, c, b = problem, problem.cache, problem.batch
    return (
        _tensor(p.q), _tensor(p.k), _tensor(p.v), _tensor(p.out), _tensor(c.key), _tensor(c.value),
        _tensor(b.block_table), _tensor(b.query_start), _tensor(b.seq_lens), _tensor(b.context_lens),
        *_PLAIN["cache"](c), *_PLAIN["batch"](b), *_PLAIN["options"](p.options),
        *map(_tensor, _TENSORS["cache"](c) + _TENSORS["batch"](b) + _TENSORS["options"](p.options)),
        backend,  # a Backend object is held by the key, so its identity stays unique
        _backend_env(), id(names), tables_state(),
    )


def remembered(signature: tuple) -> Optional[Plan]:
    """The plan :func:`remember` kept for ``signature``, or None."""
    try:
        return _plans.get(signature)
    except TypeError:  # an argument that cannot be hashed: validation will say what is wrong with it
        return None


def remember(signature: tuple, plan: Plan) -> None:
    try:
        hash(signature)
    except TypeError:
        return
    with _lock:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[signature] = plan


def forget() -> None:
    """Drop every plan (after the registry is reset or plugins change)."""
    with _lock:
        _plans.clear()
