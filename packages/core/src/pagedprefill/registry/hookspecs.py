"""The hook specifications a backend plugin implements.

A backend package exposes a module (or object) through the ``pagedprefill.backends`` entry-point group;
that module implements :func:`pagedprefill_backends` with ``@pagedprefill.hookimpl``, and optionally
:func:`pagedprefill_detect_device` (to recognise its hardware) and :func:`pagedprefill_described_devices`::

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


@hookspec(firstresult=True)
def pagedprefill_detect_device(device, info):
    """Optional: recognise ``device`` as this plugin's hardware and describe it, or return None.

    Args:
        device: the ``torch.device`` being detected, with its index (any type: ``cuda``, ``xpu``, ``cpu``...).
        info: what torch and Triton report about it in general (:func:`pagedprefill.device.general_info`):
            vendor ``nvidia``/``amd`` for ``cuda`` devices, else the device type; limits nobody reported
            are 0. A ``PAGEDPREFILL_VENDOR`` override is already applied to ``info.vendor``.

    Returns:
        A :class:`pagedprefill.DeviceInfo` (usually ``info.replace(vendor=..., ...)`` with the limits the
        plugin knows), or None when the device is not this plugin's. The first plugin to answer wins;
        a vendor set by ``PAGEDPREFILL_VENDOR`` is kept whatever the answer.

    Called once per device (the result is cached by the registry). It may query the device's runtime,
    but must be quick and should not raise: a hook that raises is recorded as the plugin's error and
    skipped. Implementations may take only the arguments they need (``def pagedprefill_detect_device(info)``).
    """
