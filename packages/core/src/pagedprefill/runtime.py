"""The process-wide registry and the dispatch every entry point runs.

:func:`dispatch` validates a :class:`PrefillProblem`, selects a backend for its device and runs it (or
replays the launch plan of an earlier call with the same signature, :mod:`pagedprefill.plans`). The public
functions (:mod:`pagedprefill.api`, :mod:`pagedprefill.vllm`, through :mod:`pagedprefill.calls`) and the
custom operators (:mod:`pagedprefill.ops`) all end here; this module imports none of them, so the operators
can sit below the public functions (see docs/architecture.md, "Layers"). :func:`new_output` allocates the
output of a call whose caller passes none (the native API and the functional operator).
"""

from __future__ import annotations

import threading
from typing import Optional, Union

import torch

from . import plans
from .device import DeviceInfo, DeviceLike, install_detection
from .features import check_runnable
from .placement import require_device
from .registry import Backend, Registry
from .types import FP8_QUERY_DTYPES, PrefillProblem, fp8_query_compute_dtype
from .validation import NATIVE_NAMES, ArgumentNames, ValidateMode, validate_problem, validate_values

__all__ = ["BackendChoice", "available_backends", "dispatch", "get_registry", "reset_registry", "select_backend"]

BackendChoice = Union[str, Backend, None]

_registry: Optional[Registry] = None
_registry_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry: core's reference backend plus every installed plugin."""
    global _registry
    if _registry is None:
        with _registry_lock:
            if _registry is None:
                from .backends import reference

                _registry = Registry(builtins=[reference])
    return _registry


def _detect(device: torch.device) -> DeviceInfo:
    return get_registry().detect_device(device)


# DeviceInfo.detect asks the process-wide registry's detection hooks (the device module sits below this one).
install_detection(_detect)


def reset_registry() -> None:
    """Forget discovered plugins and cached choices (plugins are discovered again on next use)."""
    global _registry
    with _registry_lock:
        _registry = None
    plans.forget()


def select_backend(device: Union[DeviceLike, DeviceInfo] = None, backend: BackendChoice = None) -> Backend:
    """The backend that runs on ``device`` (default: the current device), following the selection rules.

    ``device`` may be a torch device (or index/string) or a hand-written :class:`DeviceInfo`.
    Raises :class:`~pagedprefill.BackendUnavailableError` with every backend's reasons when none fits, and
    :class:`~pagedprefill.DeviceUnavailableError` naming ``device`` when it is absent (a hand-written
    :class:`DeviceInfo` describes hardware that need not be present, and is not checked).
    """
    if device is not None and not isinstance(device, DeviceInfo):
        device = require_device("device", device)
    info = device if isinstance(device, DeviceInfo) else DeviceInfo.detect(device)
    return get_registry().select(info, backend)


def available_backends() -> list[Backend]:
    """Every discovered backend, highest priority first (whether or not it supports this device)."""
    return get_registry().backends()


def dispatch(problem: PrefillProblem, backend: BackendChoice = None, validate: ValidateMode = "basic",
             names: ArgumentNames = NATIVE_NAMES) -> torch.Tensor:
    """Validate ``problem``, run it on the chosen backend, and return ``problem.out``.

    ``names`` is how errors name the arguments (the native names by default; ``DROP_IN_NAMES`` for
    :func:`context_attention_fwd`, ``VLLM_NAMES`` for :func:`pagedprefill.vllm.context_attention_fwd`).
    A backend that reads the metadata on the host anyway (the reference) gets the ``"full"`` value checks
    even with ``validate="basic"``. A backend refuses optional features it does not list in
    ``supported_features`` (:mod:`pagedprefill.features`).
    """
    signature = None
    if validate == "basic":
        # A call like an earlier one (same shapes, strides, dtypes, options) repeats its decisions: launch.
        signature = plans.call_signature(problem, backend, names)
        plan = plans.remembered(signature)
        if plan is not None and plan(problem):
            return problem.out
    validate_problem(problem, validate, names)
    info = DeviceInfo.detect(problem.device)
    chosen = get_registry().select(info, backend)
    host_checks = chosen.reads_metadata_on_host
    if validate == "basic" and host_checks:
        try:
            validate_values(problem, names)
        except ValueError as exc:
            raise ValueError(f"{exc} (pass validate='full' to have every backend check this before running)") \
                from None
    check_runnable(chosen, problem, info)
    plan = chosen.bind(problem, info)
    if signature is not None and not host_checks:
        plans.remember(signature, plan)
    return problem.out


def new_output(q: torch.Tensor, fp8_out_scale, skip_decode: bool, k=None, k_cache=None) -> torch.Tensor:
    """The output tensor allocated when the caller passes none (zeros where rows may stay unwritten): in
    ``q``'s dtype, FP8 with ``fp8_out_scale``, and for an FP8 ``q`` in the 16-bit type of ``k`` or of an
    unquantised ``k_cache`` (bfloat16 when neither is 16-bit)."""
    dtype = q.dtype
    if fp8_out_scale is not None:
        dtype = torch.float8_e4m3fn
    elif q.dtype in FP8_QUERY_DTYPES:
        dtype = fp8_query_compute_dtype(k, k_cache)
    if skip_decode:
        return torch.zeros(q.shape, dtype=dtype, device=q.device)
    return torch.empty(q.shape, dtype=dtype, device=q.device)
