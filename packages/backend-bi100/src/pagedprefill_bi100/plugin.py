"""Entry point of the ``bi100`` backend (cheap: imports no Triton, queries no device)."""

import pagedprefill


@pagedprefill.hookimpl
def pagedprefill_backends():
    from .backend import Bi100Backend

    return [Bi100Backend()]


@pagedprefill.hookimpl
def pagedprefill_described_devices():
    from . import described_devices

    return described_devices()
