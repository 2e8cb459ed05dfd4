"""Warnings for automatic selections that fall back: a backend that would run on a device but for something in
the installation or the environment, passed over for a lower one.

A backend says which of its reasons are of that kind by returning them as :class:`Fallback` (a ``str``): "the
interpreter needs numpy < 2.4", as opposed to "this is not my vendor's device". When the automatic choice
passes over a backend with such a reason, or a plugin failed to load, the user is told once per process with a
:class:`FallbackWarning`, so that a different backend never runs silently. An explicit choice (``backend=``,
``PAGEDPREFILL_BACKEND``) does not fall back: it raises instead.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Iterable

from ..device import DeviceInfo

__all__ = ["Fallback", "FallbackWarning", "fallbacks_of", "warn_fallback"]


class Fallback(str):
    """A reason why a backend cannot run on a device that is its own: a package, a version or a variable of
    this installation stops it, and a lower backend runs instead. Selection warns about it once per process."""


class FallbackWarning(UserWarning):
    """An automatic selection chose a lower backend than it would have in a working installation."""


_warned: set = set()
_warned_lock = threading.Lock()


def fallbacks_of(passed_over: Iterable[tuple[str, list[str]]], load_errors: dict[str, str]) -> tuple:
    """What an automatic choice fell back from: the :class:`Fallback` reasons of the backends ``passed_over``
    (``(name, reasons)``, ranked above the choice) and the plugins of ``load_errors`` (``{name: error}``), as
    ``(what, why)`` pairs for :func:`warn_fallback`."""
    causes = [(f"backend {name!r} cannot run on it: ", str(reason)) for name, reasons in passed_over
              for reason in reasons if isinstance(reason, Fallback)]
    causes += [(f"plugin {name!r} is not available: ", error) for name, error in load_errors.items()]
    return tuple(causes)


def warn_fallback(fallbacks: tuple, chosen: str, device: DeviceInfo) -> None:
    """Warn that ``chosen`` runs on ``device`` because of each of ``fallbacks`` (:func:`fallbacks_of`), once per
    process for each."""
    for what, why in fallbacks:
        key = (what, why, chosen)
        with _warned_lock:
            if key in _warned:
                continue
            _warned.add(key)
        warnings.warn(f"pagedprefill runs backend {chosen!r} on {device.name} ({device.torch_device}) because "
                      f"{what}{why} ('pagedprefill info' shows every backend's reasons)", FallbackWarning,
                      stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside pagedprefill, so that the warning points at the caller's
    line (a call, or ``import pagedprefill``) rather than at the registry."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "pagedprefill":
        level, frame = level + 1, frame.f_back
    return level
