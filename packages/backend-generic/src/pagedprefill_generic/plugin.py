"""Entry point of the ``generic`` backend (cheap: imports no Triton)."""

import pagedprefill


@pagedprefill.hookimpl
def pagedprefill_backends():
    from .backend import GenericBackend

    return [GenericBackend()]


@pagedprefill.hookimpl(trylast=True)
def pagedprefill_detect_device(info):
    from .detect import detect_cuda_compatible

    return detect_cuda_compatible(info)
