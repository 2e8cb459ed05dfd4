"""Whether this process can put tensors on a device, and the error naming the argument when it cannot.

torch's own errors for a device that is absent (``AssertionError: Torch not compiled with CUDA enabled``,
``RuntimeError: Found no NVIDIA driver``) name no argument, and a device that is merely described is
accepted by selection as if it were there. The public functions that take a ``device`` check it with
:func:`require_device` before allocating anything; the command line's ``--device`` uses
:func:`device_problem` with its own wording of the way out.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .errors import DeviceUnavailableError

__all__ = ["device_problem", "require_device"]

DeviceArgument = Union[str, int, torch.device]


def device_problem(device: torch.device, instead: str) -> Optional[str]:
    """Why this process cannot use ``device``, ending with what to do, or None when it can.

    ``instead`` is the way out in the caller's terms (``"use --device cpu"``, ``"pass device='cpu'"``).
    """
    if device.type == "cuda":
        return _cuda_problem(device, instead)
    if device.type in ("cpu", "meta"):
        return None
    runtime = getattr(torch, device.type, None)
    is_available = getattr(runtime, "is_available", None)
    if callable(is_available) and not is_available():
        return f"no {device.type} device is available to this torch ({torch.__version__}); {instead}"
    return None


def _cuda_problem(device: torch.device, instead: str) -> Optional[str]:
    # Availability first: vendor builds that expose their GPUs as `cuda` need not set torch.version.cuda.
    if not torch.cuda.is_available():
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return (f"this torch ({torch.__version__}) is built without CUDA; install a CUDA build of torch, "
                    f"or {instead}")
        return f"no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES), or {instead}"
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return f"only {count} CUDA device(s) are visible (cuda:0 to cuda:{count - 1})"
    return None


def require_device(name: str, value: DeviceArgument) -> torch.device:
    """``value`` as a torch device this process can use; raises naming the argument ``name`` otherwise.

    An int is an index of the current accelerator, as ``torch.device(int)`` reads it. Raises ``ValueError`` for
    a string that names no device type, and :class:`~pagedprefill.DeviceUnavailableError` (a ``ValueError`` and
    a :class:`~pagedprefill.BackendUnavailableError`) for a device that is not present.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise TypeError(f"{name}: expected a torch device, a device string such as 'cpu' or 'cuda:0', or an "
                        f"index, got {type(value).__name__}")
    try:
        device = torch.device(value)
    except RuntimeError:
        if isinstance(value, int):  # torch finds no accelerator for the index to belong to
            raise DeviceUnavailableError(
                f"{name}: expected a device this process can use, got {value} (an index of the accelerator): this "
                f"torch ({torch.__version__}) sees no accelerator; pass {name}='cpu'") from None
        raise ValueError(f"{name}: expected a torch device such as 'cpu', 'cuda' or 'cuda:1', got {value!r}") \
            from None
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a torch device such as 'cpu', 'cuda' or 'cuda:1', got {value!r}") \
            from None
    problem = device_problem(device, f"pass {name}='cpu'")
    if problem:
        raise DeviceUnavailableError(f"{name}: expected a device this process can use, got {str(device)!r}: {problem}")
    return device
