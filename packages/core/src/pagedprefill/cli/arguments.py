"""Argument types and the parser class shared by the ``pagedprefill`` subcommands."""

from __future__ import annotations

import argparse

import torch

from ..placement import device_problem


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
    problem = device_problem(device, "use --device cpu")
    if problem:
        raise argparse.ArgumentTypeError(f"{device}: {problem}")
    return device


def data_device(text: str) -> torch.device:
    """argparse type: a device that holds data, for the commands that compute (``demo``, ``bench``, ``tune``):
    a :func:`torch_device` other than ``meta``, whose tensors have shapes but no values."""
    device = torch_device(text)
    if device.type == "meta":
        raise argparse.ArgumentTypeError(f"{device}: meta tensors hold no data, so nothing can be computed or "
                                         "checked on them; use --device cpu or a GPU")
    return device
