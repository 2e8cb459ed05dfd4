"""The hook specifications a backend plugin implements.

A backend package exposes a module (or object) through the ``pagedprefill.backends`` entry-point group;
that module implements :func:`pagedprefill_backends` with ``@pagedprefill.hookimpl``::

    # pyproject.toml
    [project.entry-points."pagedprefill.backends"]
    mybackend = "pagedprefill_mybackend.plugin"

    # pagedprefill_mybackend/plugin.py
    import pagedprefill

    @pagedprefill.hookimpl
    def pagedprefill_backends():
        from .backend import MyBackend   # keep imports here cheap: no Triton, no device queries
        return [MyBackend()]
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "pagedprefill"
ENTRY_POINT_GROUP = "pagedprefill.backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def pagedprefill_backends():
    """Return a list of :class:`pagedprefill.Backend` instances this plugin provides.

    Called once, when the registry first loads plugins. It must not import Triton, compile kernels or
    query a device: registering is cheap, and selection asks each backend ``supports(device)`` later.
    """


@hookspec
def pagedprefill_described_devices():
    """Optional: return ``{name: DeviceInfo}`` of devices this plugin knows, for ``pagedprefill info --describe``.

    Lets a backend show how selection would go on hardware that is not present (names are matched
    case-insensitively). Must be cheap, like :func:`pagedprefill_backends`.
    """
