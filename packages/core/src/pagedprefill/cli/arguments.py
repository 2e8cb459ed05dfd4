"""Argument types and the parser class shared by the ``pagedprefill`` subcommands."""

from __future__ import annotations

import argparse
from typing import Optional

import torch


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line that points to ``--help`` (exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a count of runs, a size)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def torch_device(text: str) -> torch.device:
    """argparse type: a torch device that this torch build can use now (``cpu``, ``cuda``, ``cuda:1``...)."""
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a torch device such as cpu, cuda or cuda:1, got {text!r}") \
            from None
    problem = device_problem(device)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return device


def data_device(text: str) -> torch.device:
    """argparse type: a device that holds data, for the commands that compute (``demo``, ``bench``, ``tune``):
    a :func:`torch_device` other than ``meta``, whose tensors have shapes but no values."""
    device = torch_device(text)
    if device.type == "meta":
        raise argparse.ArgumentTypeError(f"{device}: meta tensors hold no data, so nothing can be computed or "
                                         "checked on them; use --device cpu or a GPU")
    return device


def device_problem(device: torch.device) -> Optional[str]:
    """Why this process cannot use ``device`` (and what to do), or None when it can."""
    if device.type == "cuda":
        return _cuda_problem(device)
    if device.type in ("cpu", "meta"):
        return None
    runtime = getattr(torch, device.type, None)
    is_available = getattr(runtime, "is_available", None)
    if callable(is_available) and not is_available():
        return f"{device}: no {device.type} device is available to this torch ({torch.__version__}); use --device cpu"
    return None


def _cuda_problem(device: torch.device) -> Optional[str]:
    # Availability first: vendor builds that expose their GPUs as `cuda` need not set torch.version.cuda.
    if not torch.cuda.is_available():
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return (f"{device}: this torch ({torch.__version__}) is built without CUDA; install a CUDA build of "
                    "torch, or use --device cpu")
        return f"{device}: no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES), or use --device cpu"
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return f"{device}: only {count} CUDA device(s) are visible (cuda:0 to cuda:{count - 1})"
    return None
