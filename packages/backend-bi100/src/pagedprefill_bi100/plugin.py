"""Entry point of the ``bi100`` backend (cheap: imports no Triton; only detection looks at a device)."""

import pagedprefill


@pagedprefill.hookimpl
def pagedprefill_backends():
    from .backend import Bi100Backend

    return [Bi100Backend()]


@pagedprefill.hookimpl
def pagedprefill_described_devices():
    from . import described_devices

    return described_devices()


@pagedprefill.hookimpl
def pagedprefill_detect_device(info):
    from .detect import detect_iluvatar

    return detect_iluvatar(info)
