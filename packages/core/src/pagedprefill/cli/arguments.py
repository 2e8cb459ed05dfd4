"""Argument types and the parser class shared by the ``pagedprefill`` subcommands.

Nothing here imports torch until an argument needs it (a ``--device`` to check, a help that names what the
backends know): the parser is built and ``--help`` answers without it.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line that points to ``--help`` (exit status 2).

    An argument whose help names what only the library knows (the devices the installed backends describe)
    carries a ``late_help`` function: its help is completed when the help is shown, not when the parser is built.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def format_help(self) -> str:
        """The help, with every ``late_help`` filled in first."""
        for action in self._actions:
            late_help = getattr(action, "late_help", None)
            if late_help is not None:
                action.help, action.late_help = late_help(), None
        return super().format_help()


def load_library() -> None:
    """Import the library as ``import pagedprefill`` does (torch without its NumPy warning, the operators, the
    backend chosen at import): the command starts without it, and what needs torch calls this first."""
    from .. import _facade  # noqa: F401


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
    load_library()
    import torch

    from ..placement import device_problem

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
